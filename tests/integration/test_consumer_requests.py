"""A consumer's requests to the broker are counted by API, on the real broker and clients: a
service consumer's from the service's start, before any record comes (its fetches go on while
nothing comes, and each is counted), the scheduler feed's readers from their start. aiokafka
has no hook for this; an upgrade that stops sending fetches, commits or heartbeats through
the client's `send` fails here. (Metadata requests go around `send` and are not counted:
docs/metrics.md.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.common.consumer import ConsumerMetrics, Consumers, Records, count_requests
from services.common.kafka import make_broker
from services.common.settings import ServiceSettings
from services.scheduler.feed import Feed
from tests.integration.kafka_tools import eventually, fresh_topic, produce

pytestmark = pytest.mark.integration

METRIC = "qm_consumer_kafka_requests_total"


def count(registry: CollectorRegistry, group: str, api: str) -> float:
    return registry.get_sample_value(METRIC, {"group": group, "api": api}) or 0.0


async def test_a_service_consumers_requests_are_counted_by_api(topics_ready: str) -> None:
    topic = await fresh_topic(topics_ready, "requests")
    group = f"{topic}-g"
    settings = ServiceSettings(
        kafka_bootstrap=topics_ready, fetch_max_wait_ms=20, fetch_idle_factor=1
    )
    broker = make_broker(settings, "requests-test")
    registry = CollectorRegistry()
    consumers = Consumers(broker, settings, service="requests-test", registry=registry)
    seen: list[bytes] = []

    async def handle(records: Records) -> None:
        seen.extend(r.value for r in records)

    consumers.subscribe(topic, group_id=group, handle=handle)
    await consumers.start()
    try:
        # Counted before any record: a group with nothing to read still polls the broker.
        await eventually(lambda: count(registry, group, "Fetch") >= 5)
        await produce(topics_ready, topic, [("k", b"one")])
        await eventually(lambda: seen == [b"one"])
        # Nothing more comes, and the consumer goes on asking every 20 ms: each is counted.
        after_first = count(registry, group, "Fetch")
        await eventually(lambda: count(registry, group, "Fetch") >= after_first + 10)
        # The group's other requests, under their own names: the batch's offsets committed
        # (the service runs the committer's loop; here it is flushed by hand) and the
        # member's heartbeats.
        await consumers.committer.flush()
        assert count(registry, group, "OffsetCommit") >= 1
        await eventually(lambda: count(registry, group, "Heartbeat") >= 1)
        # The same client is wrapped once, however many batches come.
        await produce(topics_ready, topic, [("k", b"two")])
        await eventually(lambda: seen == [b"one", b"two"])
        consumer = broker.subscribers[-1].consumer
        wrapped = consumer._client.send
        count_requests(consumer, consumers.metrics.requests, group)
        assert consumer._client.send is wrapped
    finally:
        await broker.stop()


async def test_the_scheduler_feeds_requests_are_counted_per_reader(topics_ready: str) -> None:
    cold = await fresh_topic(topics_ready, "requests-cold")
    hot = await fresh_topic(topics_ready, "requests-hot")
    registry = CollectorRegistry()
    applied: list[Any] = []
    feed = Feed(
        topics_ready,
        (cold, hot),
        20,
        applied.extend,
        hot=(hot,),
        metrics=ConsumerMetrics(registry),
        name="feed-under-test",
    )
    await feed.start()
    runner = asyncio.create_task(feed.run())
    try:
        await produce(topics_ready, hot, [("k", b"hot")])
        await produce(topics_ready, cold, [("k", b"cold")])
        await eventually(lambda: sorted(r.value for r in applied) == [b"cold", b"hot"])
        # Each reader under its own name, from its start, and each goes on polling.
        for name in ("feed-under-test-hot", "feed-under-test-cold"):
            before = count(registry, name, "Fetch")
            assert before >= 1
            await eventually(
                lambda name=name, before=before: count(registry, name, "Fetch") >= before + 5
            )
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await feed.stop()
