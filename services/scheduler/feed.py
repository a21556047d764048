"""Reading the scheduler's topics from the beginning, without a consumer group, so that every
process (leader or standby) holds the whole state and knows when it has caught up.

"Caught up" needs the true end of each partition. Tansu answers ListOffsets (end_offsets) with
the base offset of the last record batch + 1, not the batch's end, so reading up to it can stop
inside the last batch: a new leader would then miss the tail of its predecessor's last batch of
placements and place those jobs again. The high watermark in fetch responses is right, so a
partition counts as read only when the high watermark has reached the target too (so it comes
from a fetch answered after the batch was written, not a stale one) and the position has reached
that high watermark."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

log = structlog.get_logger()


class Feed:
    def __init__(
        self,
        bootstrap: str,
        topics: tuple[str, ...],
        fetch_max_wait_ms: int,
        apply: Callable[[list[ConsumerRecord[Any, Any]]], None],
    ) -> None:
        self._topics = topics
        self._apply = apply
        self._bootstrap = bootstrap
        self._fetch_max_wait_ms = fetch_max_wait_ms
        self._consumer: AIOKafkaConsumer | None = None
        self._targets: dict[TopicPartition, int] = {}
        self.caught_up = asyncio.Event()
        self.records = 0

    async def start(self) -> None:
        # aiokafka binds to the running loop, so the consumer is made here, not in __init__.
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=self._fetch_max_wait_ms,
            max_partition_fetch_bytes=4 << 20,
        )
        await self._consumer.start()
        partitions: list[TopicPartition] = []
        for topic in self._topics:
            ids = self._consumer.partitions_for_topic(topic)
            while ids is None:
                await self._consumer.force_metadata_update()
                ids = self._consumer.partitions_for_topic(topic)
                if ids is None:
                    await asyncio.sleep(0.2)
            partitions.extend(TopicPartition(topic, p) for p in sorted(ids))
        self._consumer.assign(partitions)
        await self._consumer.seek_to_beginning(*partitions)
        # Everything published before we started must be applied before we may decide.
        self._targets = dict(await self._consumer.end_offsets(partitions))
        await self._check_caught_up()

    def partitions_of(self, topics: tuple[str, ...]) -> list[tuple[str, int]]:
        """(topic, partition) of every partition of `topics` we read."""
        assert self._consumer is not None
        return sorted(
            (tp.topic, tp.partition) for tp in self._consumer.assignment() if tp.topic in topics
        )

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def _check_caught_up(self) -> None:
        assert self._consumer is not None
        if self.caught_up.is_set():
            return
        for tp, end in list(self._targets.items()):
            if not await self._read_to(tp, end):
                return
            del self._targets[tp]
        self.caught_up.set()
        log.info("snapshot caught up", records=self.records)

    async def catch_up(self, poll_s: float = 0.01) -> None:
        """Wait until everything published so far has been applied (a new leader must not
        decide on a view that lags the old leader's last decisions)."""
        assert self._consumer is not None
        partitions = list(self._consumer.assignment())
        targets = await self._consumer.end_offsets(partitions)
        for tp, end in targets.items():
            while not await self._read_to(tp, end):  # noqa: ASYNC110
                await asyncio.sleep(poll_s)

    async def _read_to(self, tp: TopicPartition, end: int) -> bool:
        """Whether `tp` is applied up to its true end as of when `end` was taken: a high
        watermark at least `end` (fetched after the last batch was written) and a position
        at least that high watermark."""
        assert self._consumer is not None
        highwater = self._consumer.highwater(tp)
        if highwater is None or highwater < end:
            return False
        return bool(await self._consumer.position(tp) >= highwater)

    async def run(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=200, max_records=5000)
            for records in batches.values():
                if records:
                    self._apply(records)
                    self.records += len(records)
            await self._check_caught_up()
