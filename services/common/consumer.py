"""The consumer pipeline every service uses: batches in, effects applied, offsets committed,
and no record, however hostile, and no outage, however long, stalls a partition.

A service supplies a batch step (decode, decide, write its effects and outbox in one
transaction). The pipeline runs it and, only when it returned, hands the batch's offsets to
the committer (in the background; the highest per partition wins), so an offset is never
committed before its record's effect is durable. When the step fails, the failure's class
(services.common.errors) decides:

- retryable (a store or the broker is away): the same batch is tried again in place, with
  exponential backoff and jitter (0.1 s doubling to 10 s), every try logged with the service,
  group, topic, partition, offsets and error and counted; once it has lasted
  `stall_alert_after_s`, one `alert.raised` (cause `consumer_stalled`) goes out;
- permanent (cannot be parsed, validated or stored): the batch is split in halves and each half
  tried on its own, down to the one record that fails; that record is dead-lettered with the
  reason and its exact bytes (and whatever `give_up` adds, e.g. the queue's `job.rejected`),
  and its neighbours are applied in their order. Steps are idempotent (processed event ids),
  so a half that is tried again after a rollback does nothing twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.deadletter import dead_letter, platform_alert
from services.common.errors import Failure, classify, describe
from services.common.kafka import OutMessage, publish_all, records_of
from services.common.pacing import FetchPacer
from services.common.settings import ServiceSettings

log = structlog.get_logger()

Records = tuple[ConsumerRecord[Any, Any], ...]
BatchHandler = Callable[[Records], Awaitable[None]]
# Extra messages for a record given up on (besides its dead letter), e.g. a job.rejected.
GiveUp = Callable[[ConsumerRecord[Any, Any], str], Sequence[OutMessage]]
Probe = Callable[[], Awaitable[Any]]

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 10.0
# From a hop inside a busy batch (tens of ms) to a consumer that was down for minutes.
DELAY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)


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


class Linger:
    """Spaces a consumer's batches while its records flow: after a batch that was no backlog,
    the next one starts no sooner than `linger_ms` after this one started.

    Under a steady flow a consumer that starts its next batch as soon as the last is done
    handles a record or two at a time, and each batch costs a fetch from the broker, a
    transaction in the service's store and a pass of its handler, whatever it holds. A
    consumer whose records are not on a fresh job's way to its placement and start (a read
    model, the meter, the preemptor) can wait a little and take what came meanwhile in one
    batch; the broker, the store and the service then do the fixed part of a batch fewer
    times (docs/performance.md, docs/consumers.md "Lingering").

    A backlog is read on at once: a batch is one when it, with the records its partitions
    still had behind it when they were fetched, would fill `max_records` (catching up after a
    restart or a burst is never slowed). A few records behind do not count: aiokafka holds one
    fetched answer per partition and the broker may have more by then either way. So a record
    waits up to about twice `linger_ms` more than it would (it may arrive just after its
    partition's answer was fetched, and then waits for the batch after next). The first record
    after a pause is not held (the last batch started long before), and 0 turns it off. The
    wait is spent inside the handler, so FastStream's per-message duration includes it.

    Only a real Kafka consumer lingers: the in-memory test broker hands each record to the
    handler as it is published and has nothing to gather."""

    def __init__(
        self,
        linger_ms: int,
        max_records: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.linger_s = max(0, linger_ms) / 1000
        self.max_records = max_records
        self._clock = clock
        self._sleep = sleep

    async def after(self, records: Sequence[Any], started: float, *, behind: int = 0) -> None:
        """Called once a batch begun at `started` (on `clock`) is done, with the records its
        partitions still had behind it when they were fetched."""
        if not self.linger_s or not records or len(records) + behind >= self.max_records:
            return
        rest = self.linger_s - (self._clock() - started)
        if rest > 0:
            await self._sleep(rest)


class ConsumerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.dead_letters = Counter(
            "qm_consumer_dead_letters_total",
            "Records given up on (permanent failure) and dead-lettered",
            ["group"],
            registry=registry,
        )
        self.retries = Counter(
            "qm_consumer_retries_total",
            "Batches tried again after a retryable failure",
            ["group"],
            registry=registry,
        )
        self.splits = Counter(
            "qm_consumer_split_batches_total",
            "Batches split in halves to isolate a record that fails permanently",
            ["group"],
            registry=registry,
        )
        self.stalled = Gauge(
            "qm_consumer_stalled_seconds",
            "How long the group's current batch has been failing (0 when it is not)",
            ["group"],
            registry=registry,
        )
        self.alerts = Counter(
            "qm_consumer_alerts_total",
            "Stall alerts raised (one per stall)",
            ["group"],
            registry=registry,
        )
        self.batch = Histogram(
            "qm_consumer_batch_seconds",
            "Time from a batch's arrival to its offsets handed to the committer",
            ["group"],
            registry=registry,
        )
        self.records = Counter(
            "qm_consumer_records_total",
            "Records applied or dead-lettered",
            ["group"],
            registry=registry,
        )
        self.lag = Gauge(
            "qm_consumer_lag_records",
            "Records behind the high watermark after the group's last batch, per topic (summed "
            "over the partitions this instance reads)",
            ["group", "topic"],
            registry=registry,
        )
        self.delay = Histogram(
            "qm_consumer_record_delay_seconds",
            "Age of a batch's oldest record (its broker timestamp) when the batch arrives",
            ["group"],
            buckets=DELAY_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "qm_consumer_kafka_requests_total",
            "Requests the group's Kafka consumer sent the broker, by API (Fetch, Heartbeat, "
            "OffsetCommit, ...), counted from the service's start",
            ["group", "api"],
            registry=registry,
        )


# The Kafka protocol's API keys of the requests a consumer sends through its client's `send`;
# any other is named by number.
KAFKA_APIS = {
    1: "Fetch",
    2: "ListOffsets",
    8: "OffsetCommit",
    9: "OffsetFetch",
    10: "FindCoordinator",
    11: "JoinGroup",
    12: "Heartbeat",
    13: "LeaveGroup",
    14: "SyncGroup",
}


def count_requests(consumer: Any, requests: Counter, group: str) -> None:
    """Count every request `consumer`'s client sends from now on, by API, under `group`.

    aiokafka has no hook for this: its fetcher and group coordinator send through the client's
    `send`, which is wrapped on this one client (once; a client without `send`, from another
    aiokafka, is left as it is and counts nothing). Each request is one the broker answers, so
    these say what a consumer costs the broker, polls with nothing in them included. Not
    counted: metadata requests and a new connection's version handshake, which aiokafka sends
    on the connection itself (a refresh every few minutes, and after a connection breaks).
    """
    client = getattr(consumer, "_client", None)
    send = getattr(client, "send", None)
    if send is None or getattr(client, "_qm_counted", False):
        return
    children: dict[Any, Any] = {}

    async def counted(node_id: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        key = getattr(request, "API_KEY", None)
        child = children.get(key)
        if child is None:
            child = children[key] = requests.labels(group, KAFKA_APIS.get(key, str(key)))
        child.inc()
        return await send(node_id, request, *args, **kwargs)

    client.send = counted
    client._qm_counted = True


class LagBook:
    """Each partition's lag as of the last batch read from it, summed per topic for the
    group's gauge. Uses only what the consumer already knows from its fetches (the high
    watermark of each partition, and the batch's last offset): no broker round trip."""

    def __init__(self, gauge: Gauge, group_id: str) -> None:
        self._gauge = gauge
        self._group = group_id
        self._lag: dict[TopicPartition, int] = {}

    def note(self, consumer: Any, records: Records) -> int:
        """After a batch: what is left behind the high watermark in each of its partitions.
        Partitions no longer assigned (taken by a rebalance) are forgotten. Returns the
        records left behind in the batch's partitions (0 when not known)."""
        if not isinstance(consumer, AIOKafkaConsumer) or not records:
            return 0  # FastStream's in-memory test broker has no watermarks
        return self.note_last(consumer, last_offsets(records))

    def note_last(self, consumer: Any, last: dict[TopicPartition, int]) -> int:
        """`note`, given the last offset the batch read from each of its partitions."""
        if not isinstance(consumer, AIOKafkaConsumer) or not last:
            return 0
        behind = lag_behind(last, consumer.highwater)
        self._lag.update(behind)
        assigned = consumer.assignment()
        for tp in [tp for tp in self._lag if tp not in assigned]:
            del self._lag[tp]
        for topic, lag in lag_by_topic(self._lag).items():
            self._gauge.labels(self._group, topic).set(lag)
        return sum(behind.values())


def partition_runs(
    records: Sequence[ConsumerRecord[Any, Any]],
) -> list[tuple[ConsumerRecord[Any, Any], ConsumerRecord[Any, Any]]]:
    """The first and last record of each partition in a batch laid out as a fetch returns
    it: each partition's records together, in offset order (FastStream's batch is getmany's
    per-partition lists one after the other). Each run's end is found by bisection, so this
    reads O(partitions x log records) records, not every one. (A partition whose records were
    not together would show as more than one run: callers combine them.)"""
    runs = []
    start, n = 0, len(records)
    while start < n:
        first = records[start]
        topic, partition = first.topic, first.partition
        lo, hi = start, n - 1  # records[lo] is in the run
        end = records[hi]
        if end.partition != partition or end.topic != topic:
            while hi - lo > 1:  # records[hi] is past the run
                mid = (lo + hi) // 2
                r = records[mid]
                if r.partition == partition and r.topic == topic:
                    lo = mid
                else:
                    hi = mid
            hi = lo
        runs.append((first, records[hi]))
        start = hi + 1
    return runs


def last_offsets(records: Sequence[ConsumerRecord[Any, Any]]) -> dict[TopicPartition, int]:
    """The highest offset of each partition in a batch (see `partition_runs`)."""
    out: dict[TopicPartition, int] = {}
    for _, last in partition_runs(records):
        tp = TopicPartition(last.topic, last.partition)
        out[tp] = max(out.get(tp, -1), last.offset)
    return out


def oldest_timestamp_ms(records: Sequence[ConsumerRecord[Any, Any]]) -> int:
    """The broker timestamp of a non-empty batch's oldest record: the earliest of each
    partition's first record (a partition's records are in time order: exactly with broker
    timestamps, within the producers' clock skew with theirs)."""
    return int(min(first.timestamp for first, _ in partition_runs(records)))


def partition_lag(
    records: Records, highwater: Callable[[TopicPartition], int | None]
) -> dict[TopicPartition, int]:
    """Records behind the high watermark in each partition of `records`, counted from the
    last record of the partition in the batch; partitions whose watermark is not known yet
    are left out."""
    return lag_behind(last_offsets(records), highwater)


def lag_behind(
    last: dict[TopicPartition, int], highwater: Callable[[TopicPartition], int | None]
) -> dict[TopicPartition, int]:
    """Records behind the high watermark of each partition read up to offset `last[tp]`."""
    out = {}
    for tp, offset in last.items():
        mark = highwater(tp)
        if mark is not None:
            out[tp] = max(0, mark - offset - 1)
    return out


def lag_by_topic(lag: dict[TopicPartition, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for tp, n in lag.items():
        out[tp.topic] = out.get(tp.topic, 0) + n
    return out


class Consumers:
    """A service's consumer groups, sharing one committer, one set of metrics and one way to
    fail. Set `probe` (e.g. `SELECT 1` on the service's pool) once the stores are open: it tells
    an unknown failure provoked by a record (permanent) from an outage (retryable)."""

    def __init__(
        self,
        broker: KafkaBroker,
        settings: ServiceSettings,
        *,
        service: str,
        registry: CollectorRegistry | None = None,
        committer: OffsetCommitter | None = None,
        stall_alert_after_s: float | None = None,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        self.broker = broker
        self.settings = settings
        self.service = service
        self.committer = committer or OffsetCommitter()
        self.metrics = ConsumerMetrics(registry or CollectorRegistry())
        self.stall_alert_after_s = (
            settings.stall_alert_after_s if stall_alert_after_s is None else stall_alert_after_s
        )
        self.backoff_max_s = backoff_max_s
        self.probe: Probe | None = None
        # Where dead letters and alerts go; the real broker unless a test swaps it.
        self.publish: Callable[[Sequence[OutMessage]], Awaitable[Any]] = self._publish
        # (FastStream subscriber, group, its pacer)
        self._subscribers: list[tuple[Any, str, FetchPacer]] = []

    async def _publish(self, messages: Sequence[OutMessage]) -> Any:
        return await publish_all(self.broker, messages)

    async def start(self) -> None:
        """Start the broker, and so every subscription; each group's requests to the broker are
        counted, and its fetches paced, from now (`count_requests`, `FetchPacer`), a group that
        never gets a record included. A consumer FastStream makes anew later is counted and
        paced from its first batch."""
        await self.broker.start()
        for subscriber, group_id, pacer in self._subscribers:
            consumer = getattr(subscriber, "consumer", None)
            if consumer is not None:
                count_requests(consumer, self.metrics.requests, group_id)
                if not pacer.attached:  # (a first batch may have come already)
                    pacer.attach(consumer)

    def subscribe(
        self,
        *topic_names: str,
        group_id: str,
        handle: BatchHandler,
        fetch_max_wait_ms: int | None = None,
        max_records: int | None = None,
        give_up: GiveUp | None = None,
        linger_ms: int | None = None,
    ) -> None:
        """Consume `topic_names` in group `group_id`, tuned for Tansu (shared/INFRA.md).

        `linger_ms` (default: the service's `batch_linger_ms`) spaces the batches of a
        consumer whose records flow: see `Linger`."""
        settings = self.settings
        busy = fetch_max_wait_ms or settings.fetch_max_wait_ms
        pacer = self.pacer(busy)
        limit = max_records or settings.max_batch_records
        linger = Linger(settings.batch_linger_ms if linger_ms is None else linger_ms, limit)
        subscriber = self.broker.subscriber(
            *topic_names,
            batch=True,
            group_id=group_id,
            auto_offset_reset="earliest",
            session_timeout_ms=2000,
            heartbeat_interval_ms=500,
            # Start quiet: a backlog is there at the first fetch, and the first batch makes
            # it busy. FastStream's own loop keeps the busy period (common/pacing.py).
            fetch_max_wait_ms=pacer.wait_ms,
            batch_timeout_ms=busy,
            max_records=limit,
            ack_policy=AckPolicy.MANUAL,
            parser=_tolerate_headers,
            decoder=_leave_undecoded,
        )
        self._subscribers.append((subscriber, group_id, pacer))
        group = Group(self, group_id, handle, give_up)
        lag = LagBook(self.metrics.lag, group_id)
        requests = self.metrics.requests

        broker = self.broker

        async def on_batch(_body: Any = None) -> None:
            # The batch comes from FastStream's context, not from a `KafkaMessage` parameter:
            # FastDepends resolves such a parameter with a plain function, which it runs in a
            # worker thread, so every batch cost a round trip to a thread and back. The
            # context is looked up per batch (an app that adopts the broker replaces it).
            message: KafkaMessage | None = broker.context.get_local("message")
            if message is None:
                raise RuntimeError(f"no batch in FastStream's context for group {group_id}")
            started = time.monotonic()
            count_requests(message.consumer, requests, group_id)
            records = records_of(message)
            if records:
                pacer.saw_records(message.consumer)
            await group.run(records)
            self.committer.add(message.consumer, records)
            behind = lag.note(message.consumer, records)
            if isinstance(message.consumer, AIOKafkaConsumer):
                await linger.after(records, started, behind=behind)

        on_batch.__name__ = f"on_{group_id.replace('-', '_')}"
        subscriber(on_batch)

    def pacer(self, busy_ms: int) -> FetchPacer:
        """A pacer for a consumer of this service that polls every `busy_ms` while busy."""
        settings = self.settings
        return FetchPacer(
            busy_ms,
            factor=settings.fetch_idle_factor,
            max_ms=settings.fetch_idle_max_ms,
            quiet_s=settings.fetch_idle_after_s,
            at_client=settings.fetch_wait_at == "client",
        )

    def group(self, group_id: str, handle: BatchHandler, give_up: GiveUp | None = None) -> Group:
        """The failure handling of one group without a subscription (tests, replays)."""
        return Group(self, group_id, handle, give_up)


class Group:
    """Runs one group's batches through its step with the failure handling described above."""

    def __init__(
        self, owner: Consumers, group_id: str, handle: BatchHandler, give_up: GiveUp | None
    ) -> None:
        self.owner = owner
        self.group_id = group_id
        self.handle = handle
        self.give_up = give_up
        self._failing_since: float | None = None
        self._alerted = False

    async def run(self, records: Records) -> None:
        """Apply `records`; returns once each is applied or dead-lettered. Raises only on
        cancellation (shutdown), so the batch is then redelivered to the next owner."""
        started = time.monotonic()
        metrics = self.owner.metrics
        if records:
            oldest = oldest_timestamp_ms(records) / 1000
            metrics.delay.labels(self.group_id).observe(max(0.0, time.time() - oldest))
        try:
            await self._apply(records)
        finally:
            self._recovered()
        metrics.batch.labels(self.group_id).observe(time.monotonic() - started)
        metrics.records.labels(self.group_id).inc(len(records))

    async def _apply(self, records: Records) -> None:
        delay = BACKOFF_FIRST_S
        while True:
            try:
                await self.handle(records)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failure = await self._classify(exc)
                if failure is Failure.PERMANENT:
                    await self._isolate(records, exc)
                    return
                await self._wait_to_retry(records, exc, delay)
                delay = min(delay * 2, self.owner.backoff_max_s)

    async def _isolate(self, records: Records, exc: Exception) -> None:
        if len(records) == 1:
            await self._dead_letter(records[0], exc)
            return
        self.owner.metrics.splits.labels(self.group_id).inc()
        half = len(records) // 2
        log.info(
            "batch failed permanently; splitting it to find the record",
            group=self.group_id,
            records=len(records),
            error=describe(exc),
        )
        await self._apply(records[:half])
        await self._apply(records[half:])

    async def _classify(self, exc: Exception) -> Failure:
        failure = classify(exc)
        if failure is not Failure.UNKNOWN:
            return failure
        probe = self.owner.probe
        if probe is None:
            return Failure.PERMANENT
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a cancellation that
            # arrives as the probe fails, and this retry loop then never ends (a hang at
            # shutdown while the stores are away).
            async with asyncio.timeout(5.0):
                await probe()
        except asyncio.CancelledError:
            raise
        except Exception:
            return Failure.RETRYABLE  # the stores are away: that, not the record, is the cause
        return Failure.PERMANENT

    async def _dead_letter(self, record: ConsumerRecord[Any, Any], exc: Exception) -> None:
        error = describe(exc)
        log.error(
            "record given up and dead-lettered",
            group=self.group_id,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            error=error,
            exc_info=exc,
        )
        messages = [dead_letter(record, error, consumer=self.owner.service, reason="unprocessable")]
        if self.give_up is not None:
            try:
                messages.extend(self.give_up(record, error))
            except Exception:
                log.warning("give-up hook failed; dead letter only", exc_info=True)
        delay = BACKOFF_FIRST_S
        while True:
            try:
                await self.owner.publish(messages)
                break
            except asyncio.CancelledError:
                raise
            except Exception as publish_exc:
                await self._wait_to_retry((record,), publish_exc, delay)
                delay = min(delay * 2, self.owner.backoff_max_s)
        self.owner.metrics.dead_letters.labels(self.group_id).inc()

    async def _wait_to_retry(self, records: Records, exc: Exception, delay: float) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        stalled = now - self._failing_since
        metrics = self.owner.metrics
        metrics.retries.labels(self.group_id).inc()
        metrics.stalled.labels(self.group_id).set(stalled)
        first = records[0]
        pause = delay * random.uniform(0.5, 1.0)  # jitter, not secrets
        log.warning(
            "consumer failed; retrying",
            group=self.group_id,
            topic=first.topic,
            partition=first.partition,
            offsets=f"{min(r.offset for r in records)}-{max(r.offset for r in records)}",
            records=len(records),
            error=describe(exc),
            retry_in_s=round(pause, 2),
            stalled_s=round(stalled, 1),
        )
        if stalled >= self.owner.stall_alert_after_s and not self._alerted:
            self._alerted = await self._raise_alert(first, exc, stalled)
        # Sleep no longer than it takes to reach the alert threshold, so it fires on time.
        if not self._alerted and stalled < self.owner.stall_alert_after_s:
            pause = min(pause, self.owner.stall_alert_after_s - stalled)
        await asyncio.sleep(pause)

    async def _raise_alert(
        self, record: ConsumerRecord[Any, Any], exc: Exception, stalled: float
    ) -> bool:
        service = self.owner.service
        message = platform_alert(
            alert_id=f"consumer/{self.group_id}/{int(time.time())}",
            subject=f"consumer/{self.group_id}",
            cause="consumer_stalled",
            action=(
                f"{service} has not applied {record.topic}[{record.partition}] from offset "
                f"{record.offset} for {stalled:.0f} s: {describe(exc)}. Check the service's "
                "log and the stores it writes to (PostgreSQL, Redis, the broker)."
            ),
            producer=service,
        )
        try:
            async with asyncio.timeout(10.0):
                await self.owner.publish([message])
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("stall alert could not be published; will try again", exc_info=True)
            return False
        self.owner.metrics.alerts.labels(self.group_id).inc()
        log.error("consumer stalled; alert raised", group=self.group_id, stalled_s=stalled)
        return True

    def _recovered(self) -> None:
        if self._failing_since is not None:
            log.info(
                "consumer recovered",
                group=self.group_id,
                after_s=round(time.monotonic() - self._failing_since, 1),
            )
        self._failing_since = None
        self._alerted = False
        self.owner.metrics.stalled.labels(self.group_id).set(0)


async def _tolerate_headers(records: Any, original: Callable[[Any], Awaitable[Any]]) -> Any:
    """FastStream's batch parser decodes every header value as UTF-8: one record with a
    non-UTF-8 or null header value (another platform's, or a hostile trace context) failed the
    whole batch before any step saw it, and stopped its partition. Such values are handed on
    made readable (undecodable bytes replaced, null as empty); batches without one are parsed
    as they are, at no extra cost."""
    try:
        return await original(records)
    except (UnicodeDecodeError, AttributeError):
        return await original(tuple(_readable(r) for r in records))


def _readable(record: Any) -> Any:
    if not isinstance(record, ConsumerRecord) or all(
        isinstance(value, bytes) and value.isascii() for _, value in record.headers or ()
    ):
        return record
    headers = [
        (name, value.decode("utf-8", "replace").encode() if isinstance(value, bytes) else b"")
        for name, value in record.headers or ()
    ]
    return dataclasses.replace(record, headers=headers)


async def _leave_undecoded(_message: Any) -> None:
    """Steps read the raw records themselves (they must see poison bytes to dead-letter
    them), so FastStream's per-record JSON decoding would be wasted work."""
    return None
