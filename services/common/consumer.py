"""Batch consumption with offsets committed after the handler, off the consume loop.

A handler runs on a batch; only when it returned are that batch's offsets handed to the
committer, which commits them in the background (the highest per partition wins). So the
next batch is not held up by the commit round trip, and an offset is never committed before
its record's effect is durable. A handler that raises rewinds the batch for redelivery.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from services.common.kafka import records_of
from services.common.settings import ServiceSettings

log = structlog.get_logger()

Records = tuple[ConsumerRecord[Any, Any], ...]
BatchHandler = Callable[[Records], Awaitable[None]]


class OffsetCommitter:
    """Commits the highest processed offsets, at most every `min_interval_s`: each commit is a
    broker round trip, and coalescing them costs only a little more redelivery on a crash."""

    def __init__(self, min_interval_s: float = 0.1) -> None:
        self._min_interval_s = min_interval_s
        self._pending: dict[int, tuple[AIOKafkaConsumer, dict[TopicPartition, int]]] = {}
        self._wake = asyncio.Event()
        self.failed = 0

    def add(self, consumer: AIOKafkaConsumer, records: Records) -> None:
        _, offsets = self._pending.setdefault(id(consumer), (consumer, {}))
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            offsets[tp] = max(offsets.get(tp, 0), r.offset + 1)
        self._wake.set()

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for consumer, offsets in pending.values():
            try:
                if isinstance(consumer, AIOKafkaConsumer):
                    await consumer.commit(
                        {tp: OffsetAndMetadata(o, "") for tp, o in offsets.items()}
                    )
                else:  # FastStream's in-memory test broker has no offsets to commit
                    await consumer.commit()
            except (KafkaError, AssertionError) as exc:
                # Typically a rebalance took the partition away: its new owner will see these
                # records again, and every consumer here is idempotent.
                self.failed += 1
                log.warning("offset commit failed; records will be redelivered", error=str(exc))

    async def run_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()
            await asyncio.sleep(self._min_interval_s)


def consume_batches(
    broker: KafkaBroker,
    *topics: str,
    group_id: str,
    settings: ServiceSettings,
    handle: BatchHandler,
    committer: OffsetCommitter,
    fetch_max_wait_ms: int | None = None,
    max_records: int | None = None,
) -> None:
    """Subscribe `handle` to `topics` in a consumer group tuned for Tansu (shared/INFRA.md)."""
    wait = fetch_max_wait_ms or settings.fetch_max_wait_ms
    subscriber = broker.subscriber(
        *topics,
        batch=True,
        group_id=group_id,
        auto_offset_reset="earliest",
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
        fetch_max_wait_ms=wait,
        batch_timeout_ms=wait,
        max_records=max_records or settings.max_batch_records,
        ack_policy=AckPolicy.MANUAL,
        decoder=_leave_undecoded,
    )

    async def on_batch(message: KafkaMessage) -> None:
        records = records_of(message)
        try:
            await handle(records)
        except Exception:
            await message.nack()  # seek back: the batch comes again
            raise
        committer.add(message.consumer, records)  # type: ignore[arg-type]

    on_batch.__name__ = f"on_{group_id.replace('-', '_')}"
    subscriber(on_batch)


async def _leave_undecoded(_message: Any) -> None:
    """Handlers read the raw records themselves (they must see poison bytes to dead-letter
    them), so FastStream's per-record JSON decoding would be wasted work."""
    return None
