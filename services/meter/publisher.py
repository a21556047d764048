"""Publishing the meter's outbox in batches. OutboxRelay (services.common.outbox) asks its
broker to `publish` one message at a time and then awaits all the returned futures; through
FastStream's broker, or even aiokafka's `send`, each message costs tens of microseconds, which
at tens of thousands of ticks a second was most of the meter's CPU. This publisher answers
each `publish` with a future at once, and when the relay yields, sends everything it was
given as one aiokafka batch per partition, keyed exactly as aiokafka's default partitioner
would (murmur2 of the key), so per-tenant order and partitioning are unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.partitioner import murmur2

from services.common.kafka import MAX_PRODUCER_BATCH

Pending = tuple[bytes, bytes, Sequence[tuple[str, bytes]], asyncio.Future[Any]]


def relay_producer(bootstrap: str, client_id: str) -> AIOKafkaProducer:
    """A producer with the settings of the broker factory (large batches, acks=all)."""
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        client_id=client_id,
        max_batch_size=MAX_PRODUCER_BATCH,
        max_request_size=4 * MAX_PRODUCER_BATCH,
        linger_ms=1,
        acks="all",
    )


class BatchPublisher:
    """What OutboxRelay needs of a broker: `publish(value, topic, key=, headers=)` returning a
    future that completes when the broker has the message."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self._partitions: dict[str, list[int]] = {}
        self._pending: dict[tuple[str, int], list[Pending]] = {}
        self._scheduled = False

    async def publish(
        self,
        value: bytes,
        topic: str,
        *,
        key: bytes,
        headers: dict[str, str],
        no_confirm: bool = True,
    ) -> asyncio.Future[Any]:
        partitions = self._partitions.get(topic)
        if partitions is None:
            partitions = self._partitions[topic] = sorted(await self.producer.partitions_for(topic))
        partition = partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        hdrs = [(k, v.encode()) for k, v in headers.items()]
        self._pending.setdefault((topic, partition), []).append((key, value, hdrs, done))
        if not self._scheduled:
            # Runs once the relay awaits its futures: everything published so far goes together.
            self._scheduled = True
            loop.call_soon(self._flush)
        if not no_confirm:
            await done
        return done

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        for (topic, partition), items in pending.items():
            asyncio.get_running_loop().create_task(self._send(topic, partition, items))

    async def _send(self, topic: str, partition: int, items: list[Pending]) -> None:
        try:
            start = 0
            while start < len(items):
                batch = self.producer.create_batch()
                end = start
                while end < len(items):
                    key, value, hdrs, _ = items[end]
                    if batch.append(key=key, value=value, timestamp=None, headers=hdrs) is None:
                        break  # full: the rest go in the next batch
                    end += 1
                if end == start:
                    # Larger than a whole batch: refused on its own, its batch-mates go on.
                    done = items[start][3]
                    if not done.done():
                        done.set_exception(
                            MessageSizeTooLargeError(f"a message for {topic} exceeds a batch")
                        )
                    start += 1
                    continue
                sent = await self.producer.send_batch(batch, topic, partition=partition)
                await sent
                for *_, done in items[start:end]:
                    if not done.done():
                        done.set_result(None)
                start = end
        except Exception as exc:
            for *_, done in items:
                if not done.done():
                    done.set_exception(exc)
