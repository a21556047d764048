"""services.common.kafka.send: straight to aiokafka under a connected FastStream broker; to
anything else's own `publish` otherwise, with only the arguments it takes."""

from __future__ import annotations

import asyncio
from typing import Any

from services.common.kafka import raw_producer, send


class OwnPublisher:
    """Like the meter's batch publisher: publish(value, topic, key=, headers=, no_confirm=)."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, str, bytes, dict[str, str]]] = []

    async def publish(
        self, value: bytes, topic: str, *, key: bytes, headers: dict[str, str], no_confirm: bool
    ) -> asyncio.Future[Any]:
        self.sent.append((value, topic, key, headers))
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


async def test_a_publisher_without_partitions_gets_what_it_takes() -> None:
    own = OwnPublisher()
    assert raw_producer(own) is None  # type: ignore[arg-type]
    fut = await send(own, b"{}", "job.started", "j1", (("type", "JobStarted"),))  # type: ignore[arg-type]
    assert fut is not None
    await fut
    assert own.sent == [(b"{}", "job.started", b"j1", {"type": "JobStarted"})]
