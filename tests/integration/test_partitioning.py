"""Records a service publishes land, on the real broker, on the partition Kafka's default
partitioner picks for their key (services.common.partitioner): a job's events stay together
on a topic of several partitions, wherever they were produced."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka.partitioner import DefaultPartitioner

from services.common.kafka import make_broker, send
from services.common.settings import ServiceSettings
from tests.integration.kafka_tools import fresh_topic
from tests.integration.test_meter_publisher import read_all

pytestmark = pytest.mark.integration


async def test_a_services_producer_keys_records_as_the_java_client_does(
    topics_ready: str,
) -> None:
    topic = await fresh_topic(topics_ready, "keyed", 3)
    broker = make_broker(ServiceSettings(kafka_bootstrap=topics_ready), "keyed-test")
    await broker.connect()
    keys = [f"job-{i}-{uuid.uuid4().hex[:6]}" for i in range(60)]
    try:
        acks = [await send(broker, k.encode(), topic, k, ()) for k in keys]
        await asyncio.gather(*acks)
    finally:
        await broker.stop()
    got = await read_all(topics_ready, topic, len(keys))
    expected = DefaultPartitioner()
    everything = [0, 1, 2]
    assert sorted(key.decode() for _, key, _ in got) == sorted(keys)
    for partition, key, value in got:
        assert key == value  # each record once, where its key sends it
        assert partition == expected(key, everything, everything)
    assert len({partition for partition, _, _ in got}) == 3  # the keys did spread
