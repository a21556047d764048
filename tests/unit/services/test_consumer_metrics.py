"""What the consumer pipeline measures per group: lag behind the high watermark (from the
batch's last offsets and the watermarks the consumer already holds), records and their delay."""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry

from services.common.consumer import ConsumerMetrics, Consumers, LagBook, partition_lag
from services.common.settings import ServiceSettings


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
