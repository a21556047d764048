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

from schemas.topics import JOB_QUEUED

log = structlog.get_logger()


# Polled at the leader's fast rate: new work. Everything else the scheduler reads (capacity,
# run ends, refusals, preemptions, health, budgets) is polled by a second consumer at
# `cold_fetch_max_wait_ms`: one consumer polling all ~45 partitions every 10 ms was most of an
# idle broker's CPU (Tansu answers an empty fetch only at its deadline, so the wait is the
# polling period).
HOT_TOPICS = (JOB_QUEUED,)


class Feed:
    """Reads `topics` from the beginning and applies every batch; `hot` topics with their own
    consumer (the leader polls it fast), the rest with another (polled slowly)."""

    def __init__(
        self,
        bootstrap: str,
        topics: tuple[str, ...],
        fetch_max_wait_ms: int,
        apply: Callable[[list[ConsumerRecord[Any, Any]]], None],
        *,
        hot: tuple[str, ...] = HOT_TOPICS,
        cold_fetch_max_wait_ms: int | None = None,
    ) -> None:
        self._apply = apply
        self._bootstrap = bootstrap
        hot_topics = tuple(t for t in topics if t in hot)
        cold_topics = tuple(t for t in topics if t not in hot)
        self._groups = [g for g in (hot_topics, cold_topics) if g]
        self._cold = len(self._groups) - 1 if cold_topics else None  # the cold group's index
        self._waits = [fetch_max_wait_ms] * len(self._groups)
        if self._cold is not None and cold_fetch_max_wait_ms is not None:
            self._waits[self._cold] = cold_fetch_max_wait_ms
        self._consumers: list[Any] = []
        self._owner: dict[TopicPartition, Any] = {}
        self._targets: dict[TopicPartition, int] = {}
        self.caught_up = asyncio.Event()
        self.records = 0

    async def start(self) -> None:
        # aiokafka binds to the running loop, so the consumers are made here, not in __init__.
        for topics, wait in zip(self._groups, self._waits, strict=True):
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self._bootstrap,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                fetch_max_wait_ms=wait,
                max_partition_fetch_bytes=4 << 20,
            )
            await consumer.start()
            self._consumers.append(consumer)
            partitions: list[TopicPartition] = []
            for topic in topics:
                ids = consumer.partitions_for_topic(topic)
                while ids is None:
                    await consumer.force_metadata_update()
                    ids = consumer.partitions_for_topic(topic)
                    if ids is None:
                        await asyncio.sleep(0.2)
                partitions.extend(TopicPartition(topic, p) for p in sorted(ids))
            consumer.assign(partitions)
            await consumer.seek_to_beginning(*partitions)
            # Everything published before we started must be applied before we may decide.
            self._targets.update(await consumer.end_offsets(partitions))
            self._owner.update(dict.fromkeys(partitions, consumer))
        await self._check_caught_up()

    def set_fetch_wait(self, ms: int, cold_ms: int | None = None) -> None:
        """How long the broker may hold each fetch when there is nothing new (Tansu answers
        only at that deadline): short while leading, long while standing by. `cold_ms` for
        the second consumer (default: `ms`). aiokafka reads the value for every fetch it
        sends and offers no public setter."""
        for i, consumer in enumerate(self._consumers):
            wait = cold_ms if i == self._cold and cold_ms is not None else ms
            consumer._fetcher._fetch_max_wait_ms = wait

    def partitions_of(self, topics: tuple[str, ...]) -> list[tuple[str, int]]:
        """(topic, partition) of every partition of `topics` we read."""
        return sorted((tp.topic, tp.partition) for tp in self._owner if tp.topic in topics)

    async def stop(self) -> None:
        for consumer in self._consumers:
            await consumer.stop()

    async def _check_caught_up(self) -> None:
        if self.caught_up.is_set():
            return
        for tp, end in list(self._targets.items()):
            if not await self._read_to(tp, end):
                return
            self._targets.pop(tp, None)  # both loops check: the other may have done it
        self.caught_up.set()
        log.info("snapshot caught up", records=self.records)

    async def catch_up(self, poll_s: float = 0.01) -> None:
        """Wait until everything published so far has been applied (a new leader must not
        decide on a view that lags the old leader's last decisions)."""
        targets: dict[TopicPartition, int] = {}
        for consumer in self._consumers:
            targets.update(await consumer.end_offsets(list(consumer.assignment())))
        for tp, end in targets.items():
            while not await self._read_to(tp, end):  # noqa: ASYNC110
                await asyncio.sleep(poll_s)

    async def _read_to(self, tp: TopicPartition, end: int) -> bool:
        """Whether `tp` is applied up to its true end as of when `end` was taken: a high
        watermark at least `end` (fetched after the last batch was written) and a position
        at least that high watermark."""
        consumer = self._owner[tp]
        highwater = consumer.highwater(tp)
        if highwater is None or highwater < end:
            return False
        return bool(await consumer.position(tp) >= highwater)

    async def run(self) -> None:
        """Read and apply, each consumer in its own loop (one event loop: batches are applied
        one at a time, whole)."""
        await asyncio.gather(*(self._run(c) for c in self._consumers))

    async def _run(self, consumer: Any) -> None:
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            for records in batches.values():
                if records:
                    self._apply(records)
                    self.records += len(records)
            await self._check_caught_up()
