"""Faults the stores cannot be made to produce on cue, injected around the real thing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from services.common.outbox import Transaction


class CommitInDoubt:
    """A service's outbox relay, except that the first transaction `when` picks has its commit
    answered by a dropped connection: the commit went through, but the service cannot know it
    (a database or network cut at that moment, as in bench/outages.py)."""

    def __init__(self, relay: Any, when: Callable[[Transaction], bool] = lambda _tx: True) -> None:
        self._relay = relay
        self._when = when
        self.dropped = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._relay, name)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self._relay.transaction() as tx:
            yield tx
            chosen = not self.dropped.is_set() and self._when(tx)
        if chosen:
            self.dropped.set()
            raise ConnectionResetError("connection lost while committing")
