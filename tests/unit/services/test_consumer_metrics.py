"""What the consumer pipeline measures per group: lag behind the high watermark (from the
batch's last offsets and the watermarks the consumer already holds), records and their delay."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, overload

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry

from services.common.consumer import (
    ConsumerMetrics,
    Consumers,
    LagBook,
    oldest_timestamp_ms,
    partition_lag,
)
from services.common.settings import ServiceSettings
from services.scheduler.feed import Feed


def record(
    topic: str, partition: int, offset: int, timestamp_ms: int = 0
) -> ConsumerRecord[Any, Any]:
    return ConsumerRecord(
        topic=topic,
        partition=partition,
        offset=offset,
        timestamp=timestamp_ms,
        timestamp_type=0,
        key=b"k",
        value=b"{}",
        checksum=None,
        serialized_key_size=1,
        serialized_value_size=2,
        headers=[],
    )


def fake_consumer(
    highwater: dict[TopicPartition, int], assigned: set[TopicPartition]
) -> AIOKafkaConsumer:
    """An aiokafka consumer as far as the lag book looks at it: watermarks and assignment."""
    consumer = object.__new__(AIOKafkaConsumer)
    consumer.highwater = highwater.get  # type: ignore[method-assign]
    consumer.assignment = lambda: assigned  # type: ignore[method-assign]
    return consumer


A0, A1, B0 = TopicPartition("a", 0), TopicPartition("a", 1), TopicPartition("b", 0)


def test_lag_counts_from_the_last_record_of_each_partition_in_the_batch() -> None:
    batch = (record("a", 0, 5), record("a", 0, 9), record("a", 1, 3), record("b", 0, 0))
    marks = {A0: 10, A1: 20}  # b's watermark is not known yet
    assert partition_lag(batch, marks.get) == {A0: 0, A1: 16}


def test_a_watermark_behind_the_batch_is_no_negative_lag() -> None:
    assert partition_lag((record("a", 0, 9),), {A0: 5}.get) == {A0: 0}


def test_the_lag_gauge_sums_per_topic_and_forgets_partitions_taken_away() -> None:
    registry = CollectorRegistry()
    book = LagBook(ConsumerMetrics(registry).lag, "g")
    consumer = fake_consumer({A0: 10, A1: 20, B0: 7}, {A0, A1, B0})
    book.note(consumer, (record("a", 0, 4), record("a", 1, 9), record("b", 0, 6)))

    def lag(topic: str) -> float | None:
        return registry.get_sample_value("qm_consumer_lag_records", {"group": "g", "topic": topic})

    assert (lag("a"), lag("b")) == (5 + 10, 0)
    # A rebalance took a[1]; the next batch of a[0] reads to its end.
    consumer = fake_consumer({A0: 10, A1: 30}, {A0, B0})
    book.note(consumer, (record("a", 0, 9),))
    assert lag("a") == 0


def test_the_in_memory_test_broker_has_no_lag() -> None:
    registry = CollectorRegistry()
    book = LagBook(ConsumerMetrics(registry).lag, "g")
    book.note(object(), (record("a", 0, 1),))
    assert (
        registry.get_sample_value("qm_consumer_lag_records", {"group": "g", "topic": "a"}) is None
    )


async def test_a_group_counts_its_records_and_their_delay() -> None:
    registry = CollectorRegistry()
    consumers = Consumers(KafkaBroker(), ServiceSettings(), service="queue", registry=registry)
    applied: list[int] = []

    async def handle(records: tuple[ConsumerRecord[Any, Any], ...]) -> None:
        applied.extend(r.offset for r in records)

    group = consumers.group("g", handle)
    await group.run((record("a", 0, 0), record("a", 0, 1), record("a", 0, 2)))
    assert applied == [0, 1, 2]
    assert registry.get_sample_value("qm_consumer_records_total", {"group": "g"}) == 3
    count = registry.get_sample_value("qm_consumer_record_delay_seconds_count", {"group": "g"})
    assert count == 1  # one observation per batch, not per record
    # Records stamped at the epoch: decades old when they arrive.
    older_than_a_day = registry.get_sample_value(
        "qm_consumer_record_delay_seconds_sum", {"group": "g"}
    )
    assert older_than_a_day is not None and older_than_a_day > 86_400


class Watched(Sequence[ConsumerRecord[Any, Any]]):
    """A batch that counts the records read from it and cannot be walked record by record."""

    def __init__(self, records: list[ConsumerRecord[Any, Any]]) -> None:
        self.records = records
        self.reads = 0

    def __len__(self) -> int:
        return len(self.records)

    @overload
    def __getitem__(self, i: int) -> ConsumerRecord[Any, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[ConsumerRecord[Any, Any]]: ...
    def __getitem__(self, i: Any) -> Any:
        assert isinstance(i, int), "read a slice of the batch"
        self.reads += 1
        return self.records[i]

    def __iter__(self) -> Any:
        raise AssertionError("walked the batch record by record")


def two_partitions(n: int) -> dict[TopicPartition, list[ConsumerRecord[Any, Any]]]:
    """`n` records in a[0] and a[1], as a fetch returns them: each in offset (time) order."""
    return {
        A0: [record("a", 0, 100 + i, 5_000 + i) for i in range(n)],
        A1: [record("a", 1, 7 + i, 3_000 + i) for i in range(n)],
    }


def test_a_batch_is_read_per_partition_not_per_record() -> None:
    by_partition = two_partitions(2500)
    flat = [r for rs in by_partition.values() for r in rs]
    marks = {A0: 10_000, A1: 2_600}
    # What the per-record scan found: the same lag and the same oldest record.
    expected_lag = {A0: 10_000 - (100 + 2499) - 1, A1: 2_600 - (7 + 2499) - 1}
    assert min(r.timestamp for r in flat) == 3_000
    batch = Watched(flat)
    assert partition_lag(batch, marks.get) == expected_lag  # type: ignore[arg-type]
    assert oldest_timestamp_ms(batch) == 3_000
    assert batch.reads < 2 * 2 * 14  # two bisections of 5000 records each, twice

    # The scheduler feed: its fetch's lists as they are, nothing copied record by record.
    registry = CollectorRegistry()
    metrics = ConsumerMetrics(registry)
    feed = Feed("unused:9092", ("a",), 10, lambda _rs: None, metrics=metrics)
    watched = {tp: Watched(rs) for tp, rs in by_partition.items()}
    book = LagBook(metrics.lag, "feed")
    before = time.time()
    feed._observe(fake_consumer(marks, {A0, A1}), "feed", book, watched, 0.0)  # type: ignore[arg-type]
    assert sum(w.reads for w in watched.values()) <= 4  # first and last of each partition
    lag = registry.get_sample_value("qm_consumer_lag_records", {"group": "feed", "topic": "a"})
    assert lag == sum(expected_lag.values())
    assert registry.get_sample_value("qm_consumer_records_total", {"group": "feed"}) == 5000
    delay = registry.get_sample_value("qm_consumer_record_delay_seconds_sum", {"group": "feed"})
    assert delay is not None and before - 3.0 <= delay <= time.time() - 3.0
