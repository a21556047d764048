"""Pacing on the real broker and the real clients: a service consumer starts quiet (the long
wait on its aiokafka fetcher), is busy (its short wait) when it handles a record, and quiet
again once none came for `fetch_idle_after_s`, while FastStream's own loop keeps the short
period throughout; the scheduler feed's consumers too, and a replica taking the lead is busy
at once. The waits held at the broker (QM_FETCH_WAIT_AT=broker) are checked on the fetcher;
spent at the client (the default), on the broker's requests."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
from faststream.kafka import KafkaBroker

from services.common.consumer import Consumers, Records
from services.common.kafka import make_broker
from services.common.settings import ServiceSettings
from services.scheduler.feed import Feed
from tests.integration.kafka_tools import (
    create_topic,
    eventually,
    fresh_topic,
    produce,
    topic_name,
)

pytestmark = pytest.mark.integration


def paced(
    bootstrap: str, service: str, *, idle_max_ms: int, wait_at: Literal["broker", "client"]
) -> tuple[KafkaBroker, Consumers]:
    """A service's broker and consumers polling every 20 ms while busy, ten times slower (at
    most every `idle_max_ms`) after 0.5 s without records, waiting at `wait_at`."""
    settings = ServiceSettings(
        kafka_bootstrap=bootstrap,
        fetch_max_wait_ms=20,
        fetch_idle_factor=10,
        fetch_idle_max_ms=idle_max_ms,
        fetch_idle_after_s=0.5,
        fetch_wait_at=wait_at,
    )
    broker = make_broker(settings, service)
    return broker, Consumers(broker, settings, service=service)


async def test_a_service_consumer_polls_fast_only_while_records_come(topics_ready: str) -> None:
    topic = await fresh_topic(topics_ready, "pacing")
    broker, consumers = paced(topics_ready, "pacing-test", idle_max_ms=300, wait_at="broker")
    seen: list[tuple[bytes, int, int]] = []
    subscriber: list[Any] = []

    async def handle(records: Records) -> None:
        # What the consumer and its subscriber have while this batch is handled.
        sub = subscriber[0]
        for r in records:
            seen.append((r.value, sub.consumer._fetcher._fetch_max_wait_ms, sub.batch_timeout_ms))

    consumers.subscribe(topic, group_id=f"{topic}-g", handle=handle)
    subscriber.append(broker.subscribers[-1])
    await broker.start()
    try:
        sub = subscriber[0]
        await eventually(lambda: getattr(sub, "consumer", None) is not None)
        # Quiet from the start: nothing to read yet.
        assert sub.consumer._fetcher._fetch_max_wait_ms == 200
        assert sub.batch_timeout_ms == 20
        await produce(topics_ready, topic, [("k", b"first")])
        await eventually(lambda: len(seen) == 1)
        assert seen[0] == (b"first", 20, 20)
        # Nothing more: back to the long wait.
        await eventually(lambda: sub.consumer._fetcher._fetch_max_wait_ms == 200)
        assert sub.batch_timeout_ms == 20
        await produce(topics_ready, topic, [("k", b"second")])
        await eventually(lambda: len(seen) == 2)
        assert seen[1] == (b"second", 20, 20)
    finally:
        await broker.stop()


async def test_the_scheduler_feed_paces_each_consumer(topics_ready: str) -> None:
    topic = await fresh_topic(topics_ready, "pacing")
    applied: list[tuple[bytes, int]] = []

    def apply(records: list[Any]) -> None:
        wait = feed._consumers[0]._fetcher._fetch_max_wait_ms
        applied.extend((r.value, wait) for r in records)

    feed = Feed(
        topics_ready,
        (topic,),
        20,
        apply,
        hot=(),
        cold_fetch_max_wait_ms=30,
        idle_factor=10,
        idle_max_ms=300,
        quiet_s=0.5,
    )
    await feed.start()
    runner = asyncio.create_task(feed.run())
    try:
        fetcher = feed._consumers[0]._fetcher
        # Busy from the start (it reads the log first), quiet once nothing comes.
        await eventually(lambda: fetcher._fetch_max_wait_ms == 300)
        await produce(topics_ready, topic, [("k", b"one")])
        await eventually(lambda: applied == [(b"one", 30)])
        feed.set_fetch_wait(250, 40)  # standing by: the new busy wait, quiet or not
        await eventually(lambda: fetcher._fetch_max_wait_ms == 300)
        await produce(topics_ready, topic, [("k", b"two")])
        await eventually(lambda: applied == [(b"one", 30), (b"two", 40)])
        await eventually(lambda: fetcher._fetch_max_wait_ms == 300)
        feed.set_fetch_wait(250, 25)  # taking the lead: busy at once, without a record
        assert fetcher._fetch_max_wait_ms == 25
        await eventually(lambda: fetcher._fetch_max_wait_ms == 250)  # and quiet again
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await feed.stop()


async def test_the_scheduler_feed_waits_for_a_topic_made_after_it_started(
    topics_ready: str,
) -> None:
    """The feed reads partitions from the metadata its consumer has; a topic that is not
    there yet is waited for (metadata asked again every 0.2 s), not an error."""
    there = await fresh_topic(topics_ready, "feed-there")
    later = topic_name("feed-later")
    feed = Feed(topics_ready, (there, later), 20, lambda records: None, hot=())
    starting = asyncio.create_task(feed.start())
    try:
        await asyncio.sleep(0.5)  # long enough for it to be looking; passes without as well
        await create_topic(topics_ready, later, 3)
        await asyncio.wait_for(starting, 30)
        assigned = feed._consumers[0].assignment()
        assert {(tp.topic, tp.partition) for tp in assigned if tp.topic == later} == {
            (later, 0),
            (later, 1),
            (later, 2),
        }
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await feed.stop()


async def test_waiting_at_the_client_asks_the_broker_not_to_wait_and_still_polls_at_its_pace(
    topics_ready: str,
) -> None:
    """QM_FETCH_WAIT_AT=client: every fetch asks the broker to hold it the busy wait, and a
    quiet consumer's fetch that found nothing is followed by the rest of its long wait at the
    client: it sends about one fetch per long wait, not one per busy wait. Records are read as
    before."""
    topic = await fresh_topic(topics_ready, "pacing-client")
    broker, consumers = paced(topics_ready, "pacing-client-test", idle_max_ms=200, wait_at="client")
    seen: list[bytes] = []

    async def handle(records: Records) -> None:
        seen.extend(r.value for r in records)

    group = f"{topic}-g"
    consumers.subscribe(topic, group_id=group, handle=handle)
    await consumers.start()
    try:
        sub: Any = broker.subscribers[-1]
        fetcher = sub.consumer._fetcher
        assert fetcher._fetch_max_wait_ms == 20  # the busy wait
        fetches = consumers.metrics.requests.labels(group, "Fetch")
        await eventually(lambda: fetches._value.get() > 0)
        before = fetches._value.get()
        await asyncio.sleep(2.0)
        polled = fetches._value.get() - before
        # Quiet, a fetch every 200 ms: about ten in two seconds; without the wait at the
        # client, one every 20 ms (the broker's hold): a hundred.
        assert 1 <= polled <= 40, polled
        await produce(topics_ready, topic, [("k", b"first"), ("k", b"second")])
        await eventually(lambda: seen == [b"first", b"second"])
        assert fetcher._fetch_max_wait_ms == 20  # the busy wait
        # Quiet again, it rests most of the time: stopping cancels the rest, and the consumer
        # still closes all the way (its client's connections too).
        pacer = consumers._subscribers[-1][2]
        await eventually(lambda: pacer.quiet)
        await asyncio.sleep(0.3)
        consumer = sub.consumer
        await broker.stop()
        assert consumer._client._sync_task is None
    finally:
        await broker.stop()
