"""Publishing the leader's decisions and learning, message by message, whether the broker
has each one: the cycle applies to its state only what was acknowledged."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from faststream.kafka import KafkaBroker

from services.common.errors import refused_for_good
from services.common.kafka import OutMessage, send

Outcome = BaseException | None


async def publish_each(broker: KafkaBroker, messages: Sequence[OutMessage]) -> list[Outcome]:
    """Send every message with its key and wait for each answer: None once the broker has
    acknowledged it, else the error.

    A message the producer would not take because the broker is away (no metadata, a full
    buffer) stops the sending: the rest would each wait out the same timeout, so they are
    given the same error unsent. An error is not proof of absence (an acknowledgement can be
    lost after the write), so a caller must read the log back before deciding again."""
    outcomes: list[Outcome] = [None] * len(messages)
    futures: list[tuple[int, Any]] = []
    for i, msg in enumerate(messages):
        try:
            fut = await send(
                broker,
                msg.encode(),
                msg.topic,
                msg.key,
                (("type", msg.envelope.type), *msg.headers),
                msg.partition,
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            outcomes[i] = exc
            if refused_for_good(exc):  # this message only (too large): the others may pass
                continue
            outcomes[i + 1 :] = [exc] * (len(messages) - i - 1)
            break
        if fut is not None:  # None: the in-memory test broker delivered it at once
            futures.append((i, fut))
    results = await asyncio.gather(*(f for _, f in futures), return_exceptions=True)
    for (i, _), result in zip(futures, results, strict=True):
        if isinstance(result, BaseException):
            outcomes[i] = result
    return outcomes
