"""The meter's batch publisher on the real broker: a relay's batch goes out in per-partition
batches to the partitions aiokafka's default partitioner would pick, in order per key, with
an outcome per message; a message too large for a batch fails alone."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner

from services.common.kafka import MAX_PRODUCER_BATCH, Wire, send_each
from services.meter.publisher import MAX_REQUEST, BatchPublisher, relay_producer
from tests.integration.kafka_tools import START_S, STOP_S, bounded, fresh_topic

pytestmark = pytest.mark.integration

PARTITIONS = 3


async def read_all(bootstrap: str, topic: str, count: int) -> list[tuple[int, bytes, bytes]]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=20
    )
    await bounded(consumer.start(), START_S, "a test consumer's start")
    got: list[tuple[int, bytes, bytes]] = []
    try:
        for _ in range(300):
            for records in (await consumer.getmany(timeout_ms=100)).values():
                got += [(r.partition, r.key, r.value) for r in records]
            if len(got) >= count:
                break
    finally:
        await bounded(consumer.stop(), STOP_S, "a test consumer's stop")
    return got


async def test_a_batch_goes_to_the_default_partitions_in_order_with_outcomes(
    topics_ready: str,
) -> None:
    topic = await fresh_topic(topics_ready, "publisher", PARTITIONS)
    producer = relay_producer(topics_ready, "publisher-test")
    await bounded(producer.start(), START_S, "a test producer's start")
    publisher = BatchPublisher(producer)
    try:
        tenants = ["vision", "nlp", "speech", "t\u00fcrk", "robotics"]
        wires: list[Wire] = [
            (topic, tenants[i % 5], f"{i}".encode(), (("type", "UsageTick"),), None)
            for i in range(500)
        ]
        # Larger than a batch: sent in one of its own. Larger than a request: refused alone.
        big = (topic, "speech", b"y" * (MAX_PRODUCER_BATCH + 1), (("type", "UsageTick"),), None)
        huge = (topic, "vision", b"x" * (MAX_REQUEST + 1), (("type", "UsageTick"),), None)
        wires.insert(250, huge)
        wires.insert(100, big)
        outcomes = await send_each(publisher, wires)  # type: ignore[arg-type]
        assert isinstance(outcomes[251], MessageSizeTooLargeError)
        assert outcomes[:251] + outcomes[252:] == [None] * 501
        # One more through publish(), the path the relay's dead letters may take.
        done = await publisher.publish(b"last", topic, key=b"nlp", headers={"type": "X"})
        await done
        got = await read_all(topics_ready, topic, 502)
    finally:
        await bounded(producer.stop(), STOP_S, "a test producer's stop")
    assert len(got) == 502
    expected = DefaultPartitioner()
    everything = list(range(PARTITIONS))
    for partition, key, _ in got:
        assert partition == expected(key, everything, everything)
    for tenant in tenants:
        values = [v for _, k, v in got if k == tenant.encode()]
        sent = [w[2] for w in wires if w[1] == tenant and w is not huge]
        if tenant == "nlp":
            sent.append(b"last")
        assert values == sent  # per-key order kept
