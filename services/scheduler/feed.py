"""Reading the scheduler's topics without a consumer group, from the beginning or from where a
snapshot left off (snapshot.py), so that every process (leader or standby) holds the whole
state and knows when it has caught up.

"Caught up" needs the true end of each partition. Tansu answers ListOffsets (end_offsets) with
the base offset of the last record batch + 1, not the batch's end, so reading up to it can stop
inside the last batch: a new leader would then miss the tail of its predecessor's last batch of
placements and place those jobs again. The high watermark in fetch responses is right, so a
partition counts as read only when the high watermark has reached the target too (so it comes
from a fetch answered after the batch was written, not a stale one) and the position has reached
that high watermark."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import OffsetOutOfRangeError

from schemas.topics import JOB_QUEUED
from services.common.consumer import ConsumerMetrics, LagBook, count_requests, lag_behind
from services.common.pacing import FetchPacer

log = structlog.get_logger()

# Where the feed stands in one partition: the next offset to read, and the timestamp and size
# of the last record applied (a snapshot's marks; `verify_marks` checks them against the log).
Mark = tuple[int, int, int]


# Polled at the leader's fast rate: new work. Everything else the scheduler reads (capacity,
# run ends, refusals, preemptions, health, budgets) is polled by a second consumer at
# `cold_fetch_max_wait_ms`: one consumer polling all ~45 partitions every 10 ms was most of an
# idle broker's CPU (Tansu answers an empty fetch only at its deadline, so the wait is the
# polling period).
HOT_TOPICS = (JOB_QUEUED,)
FETCH_MAX_RECORDS = 5000  # records per batch the feed takes at most


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
        metrics: ConsumerMetrics | None = None,
        name: str = "scheduler-feed",
        idle_factor: int = 1,
        idle_max_ms: int = 500,
        quiet_s: float = 5.0,
        wait_at_client: bool = False,
    ) -> None:
        self._apply = apply
        self._metrics = metrics
        self._bootstrap = bootstrap
        hot_topics = tuple(t for t in topics if t in hot)
        cold_topics = tuple(t for t in topics if t not in hot)
        self._groups = [g for g in (hot_topics, cold_topics) if g]
        self._cold = len(self._groups) - 1 if cold_topics else None  # the cold group's index
        self._waits = [fetch_max_wait_ms] * len(self._groups)
        if self._cold is not None and cold_fetch_max_wait_ms is not None:
            self._waits[self._cold] = cold_fetch_max_wait_ms
        # Named in the consumer metrics ("group" label; no Kafka group is used) by this.
        self._name = name
        self._consumers: list[Any] = []
        # Each consumer polls slowly once its topics are quiet (common/pacing.py).
        self._pacers = [
            FetchPacer(
                w, factor=idle_factor, max_ms=idle_max_ms, quiet_s=quiet_s, at_client=wait_at_client
            )
            for w in self._waits
        ]
        # Seconds each consumer's batches are spaced while records flow (set_linger).
        self._lingers = [0.0] * len(self._groups)
        self._cut = asyncio.Event()  # set to end the lingering now (set_linger shortened it)
        self._catching_up = False  # a new leader reads to the end (catch_up): no lingering
        self._owner: dict[TopicPartition, Any] = {}
        self._targets: dict[TopicPartition, int] = {}
        self._marks: dict[tuple[str, int], Mark] = {}
        self.caught_up = asyncio.Event()
        self.records = 0

    def marks(self) -> dict[tuple[str, int], Mark]:
        """Where the feed stands in every partition it has read from (a copy)."""
        return dict(self._marks)

    async def start(self, resume: dict[tuple[str, int], Mark] | None = None) -> None:
        """Assigns every partition of the topics and reads from the beginning, or, for the
        partitions in `resume` (a snapshot's marks), from where the snapshot left off."""
        resume = resume or {}
        # aiokafka binds to the running loop, so the consumers are made here, not in __init__.
        for topics, pacer in zip(self._groups, self._pacers, strict=True):
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self._bootstrap,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                fetch_max_wait_ms=pacer.busy_ms,
                max_partition_fetch_bytes=4 << 20,
            )
            await consumer.start()
            if self._metrics is not None:
                name = self._name_of(len(self._consumers))
                count_requests(consumer, self._metrics.requests, name)
            self._consumers.append(consumer)
            pacer.attach(consumer, quiet=False)  # it has the log to read first
            partitions: list[TopicPartition] = []
            for topic in topics:
                ids = consumer.partitions_for_topic(topic)
                while ids is None:
                    # A topic made after the consumer started (aiokafka's consumer has no
                    # public refresh of the metadata it reads partitions from).
                    await consumer._client.force_metadata_update()
                    ids = consumer.partitions_for_topic(topic)
                    if ids is None:
                        await asyncio.sleep(0.2)
                partitions.extend(TopicPartition(topic, p) for p in sorted(ids))
            consumer.assign(partitions)
            fresh = [tp for tp in partitions if (tp.topic, tp.partition) not in resume]
            if fresh:
                await consumer.seek_to_beginning(*fresh)
            for tp in partitions:
                mark = resume.get((tp.topic, tp.partition))
                if mark is not None:
                    consumer.seek(tp, mark[0])
                    # Only partitions read here: a snapshot's marks of others are not carried on.
                    self._marks[(tp.topic, tp.partition)] = mark
            # Everything published before we started must be applied before we may decide.
            self._targets.update(await consumer.end_offsets(partitions))
            self._owner.update(dict.fromkeys(partitions, consumer))
        await self._check_caught_up()

    def set_fetch_wait(self, ms: int, cold_ms: int | None = None) -> None:
        """How long the broker may hold each fetch when there is nothing new (Tansu answers
        only at that deadline): short while leading, long while standing by. `cold_ms` for
        the second consumer (default: `ms`). These are the busy waits: a consumer whose
        topics are quiet polls more slowly until its next record (common/pacing.py); a
        shorter one (taking the lead) makes it busy at once, to read to the end quickly."""
        for i, pacer in enumerate(self._pacers):
            wait = cold_ms if i == self._cold and cold_ms is not None else ms
            pacer.set_busy_ms(wait, wake=wait < pacer.busy_ms)

    def set_linger(self, ms: int, cold_ms: int | None = None) -> None:
        """How long each consumer gathers records into one batch while they flow and it is
        caught up (common/consumer.py, Linger): none for the leader's new work, its other
        topics as set (cold_linger_ms, none by default), some while standing by. `cold_ms`
        for the second consumer (default: `ms`). A shorter linger (taking the lead) ends the
        current one at once."""
        shorter = False
        for i in range(len(self._lingers)):
            wait = max(0, cold_ms if i == self._cold and cold_ms is not None else ms) / 1000
            shorter = shorter or wait < self._lingers[i]
            self._lingers[i] = wait
        if shorter:
            self._cut.set()
            self._cut = asyncio.Event()

    def partitions_of(self, topics: tuple[str, ...]) -> list[tuple[str, int]]:
        """(topic, partition) of every partition of `topics` we read."""
        return sorted((tp.topic, tp.partition) for tp in self._owner if tp.topic in topics)

    async def stop(self) -> None:
        for pacer in self._pacers:
            pacer.close()
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
        self._catching_up = True
        self._cut.set()  # a consumer lingering now reads on at once
        self._cut = asyncio.Event()
        try:
            targets: dict[TopicPartition, int] = {}
            for consumer in self._consumers:
                targets.update(await consumer.end_offsets(list(consumer.assignment())))
            for tp, end in targets.items():
                while not await self._read_to(tp, end):  # noqa: ASYNC110
                    await asyncio.sleep(poll_s)
        finally:
            self._catching_up = False

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
        await asyncio.gather(*(self._run(c, i) for i, c in enumerate(self._consumers)))

    def _name_of(self, index: int) -> str:
        return f"{self._name}-{'cold' if index == self._cold else 'hot'}"

    async def _run(self, consumer: Any, index: int) -> None:
        name, pacer = self._name_of(index), self._pacers[index]
        lag = LagBook(self._metrics.lag, name) if self._metrics is not None else None
        while True:
            batches = await consumer.getmany(timeout_ms=200, max_records=FETCH_MAX_RECORDS)
            started = time.monotonic()
            if any(batches.values()):
                pacer.saw_records()
            for tp, records in batches.items():
                if records:
                    self._apply(records)
                    self.records += len(records)
                    last = records[-1]
                    self._marks[(tp.topic, tp.partition)] = (
                        last.offset + 1,
                        last.timestamp,
                        len(last.value or b""),
                    )
            if lag is not None and batches:
                self._observe(consumer, name, lag, batches, time.monotonic() - started)
            await self._check_caught_up()
            await self._linger(consumer, index, batches, started)

    async def _linger(
        self,
        consumer: Any,
        index: int,
        batches: dict[TopicPartition, list[ConsumerRecord[Any, Any]]],
        started: float,
    ) -> None:
        """Space this consumer's batches while records flow (set_linger), never while the
        feed catches up (at start or taking the lead) or reads a backlog (Linger's rule)."""
        linger = self._lingers[index]
        if not linger or not self.caught_up.is_set():
            return
        last = {tp: rs[-1].offset for tp, rs in batches.items() if rs}
        if not last or self._catching_up:
            return
        behind = sum(lag_behind(last, consumer.highwater).values())
        if sum(map(len, batches.values())) + behind >= FETCH_MAX_RECORDS:
            return
        rest = linger - (time.monotonic() - started)
        if rest > 0:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that
            # comes in the same turn as the cut.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(rest):
                    await self._cut.wait()

    def _observe(
        self,
        consumer: Any,
        name: str,
        lag: LagBook,
        batches: dict[TopicPartition, list[ConsumerRecord[Any, Any]]],
        took_s: float,
    ) -> None:
        """The consumer metrics every service's groups have, once per fetch."""
        metrics = self._metrics
        assert metrics is not None
        # Per partition, not per record: each list is in offset order (and so in time order).
        batches = {tp: rs for tp, rs in batches.items() if rs}
        if not batches:
            return
        oldest = min(rs[0].timestamp for rs in batches.values()) / 1000
        metrics.delay.labels(name).observe(max(0.0, time.time() - oldest - took_s))
        metrics.batch.labels(name).observe(took_s)
        metrics.records.labels(name).inc(sum(map(len, batches.values())))
        lag.note_last(consumer, {tp: rs[-1].offset for tp, rs in batches.items()})


@dataclass(frozen=True)
class Verdict:
    """Whether a snapshot's marks belong to this log: `matches` True or False, or None when
    it could not be told (the broker slow or away: try again, do not set the snapshot aside)."""

    matches: bool | None
    why: str = ""


async def verify_marks(
    bootstrap: str, marks: dict[tuple[str, int], Mark], timeout_s: float = 10.0
) -> Verdict:
    """Whether a snapshot's marks belong to this broker's log: every partition exists and is at
    least as long as its mark, and the record before each mark, where the broker still has it,
    has the timestamp and size the snapshot noted (a snapshot of another broker, e.g. a
    development stack started afresh, must not be resumed)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        fetch_max_wait_ms=100,
        auto_offset_reset="none",  # an offset past the end raises instead of moving
    )
    wanted: dict[TopicPartition, Mark] = {}
    seen: dict[TopicPartition, ConsumerRecord[Any, Any]] = {}
    try:
        await consumer.start()
        tps = [TopicPartition(t, p) for (t, p) in marks]
        known = await _partitions(consumer, {tp.topic for tp in tps})
        absent = [f"{tp.topic}[{tp.partition}]" for tp in tps if tp not in known]
        if absent:
            return Verdict(False, f"the log has no partition {', '.join(sorted(absent)[:5])}")
        ends = await consumer.end_offsets(tps) if tps else {}
        starts = await consumer.beginning_offsets(tps) if tps else {}
        for tp in tps:
            mark = marks[(tp.topic, tp.partition)]
            # Tansu's end offset can lag the last batch's end (see above), so only an empty
            # partition is certainly shorter; the record fetched below decides the rest.
            if ends[tp] == 0 and mark[0] > 0:
                why = f"{tp.topic}[{tp.partition}] is empty, the snapshot read to {mark[0]}"
                return Verdict(False, why)
            if starts[tp] > mark[0]:
                # Retention deleted records the snapshot did not cover: nothing holds them now
                # (a replay would miss them too), so the snapshot is still the best start.
                log.error(
                    "records after the snapshot are gone",
                    topic=tp.topic,
                    partition=tp.partition,
                    snapshot_to=mark[0],
                    log_starts_at=starts[tp],
                )
            if mark[0] > 0 and starts[tp] <= mark[0] - 1:
                wanted[tp] = mark
        if not wanted:
            return Verdict(True)
        consumer.assign(list(wanted))
        for tp, mark in wanted.items():
            consumer.seek(tp, mark[0] - 1)
        async with asyncio.timeout(timeout_s):
            while len(seen) < len(wanted):
                batches = await consumer.getmany(timeout_ms=200, max_records=len(wanted) * 10)
                for tp, records in batches.items():
                    if records and tp not in seen:
                        seen[tp] = records[0]
                        consumer.pause(tp)
        for tp, mark in wanted.items():
            record = seen[tp]
            found = (record.offset + 1, record.timestamp, len(record.value or b""))
            if found != mark:
                why = (
                    f"{tp.topic}[{tp.partition}] at {mark[0] - 1}: log has {found}, snapshot {mark}"
                )
                return Verdict(False, why)
        return Verdict(True)
    except OffsetOutOfRangeError as exc:
        return Verdict(False, f"an offset before the snapshot's marks is not in the log: {exc}")
    except TimeoutError:
        missing = sorted(f"{tp.topic}[{tp.partition}]" for tp in wanted if tp not in seen)
        return Verdict(
            None, f"the records before the snapshot's marks did not arrive: {missing[:5]}"
        )
    except Exception as exc:  # the broker away or slow: no verdict, try again later
        return Verdict(None, f"could not read the log: {exc!r}"[:300])
    finally:
        await consumer.stop()


async def _partitions(consumer: AIOKafkaConsumer, topics: set[str]) -> set[TopicPartition]:
    """Every partition of `topics` the broker has (metadata, not offsets: asking offsets of a
    partition that does not exist waits out the request timeout)."""
    await consumer.topics()  # fetches the cluster's metadata
    return {TopicPartition(t, p) for t in topics for p in (consumer.partitions_for_topic(t) or ())}


async def truncated(bootstrap: str, topics: tuple[str, ...]) -> list[str]:
    """Partitions of `topics` whose log no longer starts at offset 0 (retention deleted their
    oldest records): reading them from the beginning does not rebuild the whole state."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = sorted(await _partitions(consumer, set(topics)))
        starts = await consumer.beginning_offsets(tps) if tps else {}
        return [f"{tp.topic}[{tp.partition}] from {starts[tp]}" for tp in tps if starts[tp] > 0]
    finally:
        await consumer.stop()
