"""Lingering consumers (common/consumer.py, Linger; the scheduler feed's set_linger): while
records flow, the next batch starts no sooner than the linger after the last one started; a
backlog is never held, and the first record after a pause is not held either. The clock and
the sleep are injected, so nothing here depends on how fast the machine is. And the batch
handler's way in: no worker thread on it."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest
from aiokafka import TopicPartition
from faststream.kafka import TestKafkaBroker

from services.common.consumer import Consumers, Linger, Records
from services.common.kafka import make_broker
from services.common.settings import ServiceSettings
from services.scheduler.feed import FETCH_MAX_RECORDS, Feed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def linger(ms: int, max_records: int = 10) -> tuple[Linger, Clock]:
    clock = Clock()
    return Linger(ms, max_records, clock=clock, sleep=clock.sleep), clock


async def test_a_small_batch_is_followed_by_the_rest_of_the_linger() -> None:
    lg, clock = linger(100)
    started = clock.now
    clock.now += 0.03  # the batch took 30 ms
    await lg.after([1, 2, 3], started)
    assert clock.slept == [pytest.approx(0.07)]
    assert clock.now == pytest.approx(started + 0.1)


async def test_a_batch_that_took_longer_than_the_linger_is_not_followed_by_a_wait() -> None:
    lg, clock = linger(100)
    started = clock.now
    clock.now += 0.25
    await lg.after([1], started)
    assert clock.slept == []


async def test_a_backlog_is_read_on_at_once() -> None:
    lg, clock = linger(100, max_records=3)
    await lg.after([1, 2, 3], clock.now)  # a full batch: more is waiting
    await lg.after([1], clock.now, behind=7)  # records left behind in its partitions
    await lg.after([1], clock.now, behind=2)  # with them, as many as a batch takes
    assert clock.slept == []


async def test_a_record_or_two_behind_is_no_backlog() -> None:
    """aiokafka holds one fetched answer per partition: a record that came in meanwhile
    shows as behind, and waiting for it is what lingering is for."""
    lg, clock = linger(100, max_records=10)
    await lg.after([1, 2], clock.now, behind=3)
    assert clock.slept == [pytest.approx(0.1)]


async def test_no_linger_no_records_no_wait() -> None:
    off, clock = linger(0)
    await off.after([1], clock.now)
    lg, clock2 = linger(100)
    await lg.after([], clock2.now)  # an empty poll (the in-memory broker's shape)
    assert clock.slept == [] and clock2.slept == []


async def test_a_negative_linger_is_none() -> None:
    lg, clock = linger(-5)
    await lg.after([1], clock.now)
    assert clock.slept == []


class FakeConsumer:
    def __init__(self, highwater: dict[TopicPartition, int]) -> None:
        self._highwater = highwater

    def highwater(self, tp: TopicPartition) -> int | None:
        return self._highwater.get(tp)


class Record:
    def __init__(self, offset: int) -> None:
        self.offset = offset


def feed_with(index_lingers: tuple[int, int]) -> Feed:
    feed = Feed("unused:9092", ("job.queued", "job.finished"), 10, lambda _rs: None)
    feed.set_linger(*index_lingers)
    feed.caught_up.set()
    return feed


TP = TopicPartition("job.finished", 0)


async def test_the_feed_lingers_only_its_caught_up_consumers_without_a_backlog() -> None:
    feed = feed_with((0, 60_000))  # hot: none; cold: a minute (a wait would hang the test)
    at_end = FakeConsumer({TP: 5})
    batch: dict[TopicPartition, list[Any]] = {TP: [Record(3), Record(4)]}
    loop = asyncio.get_running_loop()
    # The hot consumer (index 0) never lingers.
    await asyncio.wait_for(feed._linger(at_end, 0, batch, loop.time()), 5)
    # A backlog (the batch and what its partitions had behind it fill a fetch): read on.
    behind = FakeConsumer({TP: FETCH_MAX_RECORDS + 5})
    await asyncio.wait_for(feed._linger(behind, 1, batch, loop.time()), 5)
    # A full batch: read on.
    full = {TP: [Record(i) for i in range(FETCH_MAX_RECORDS)]}
    await asyncio.wait_for(
        feed._linger(FakeConsumer({TP: FETCH_MAX_RECORDS}), 1, full, loop.time()), 5
    )
    # Still catching up (a start or a take-over): read on.
    feed.caught_up.clear()
    await asyncio.wait_for(feed._linger(at_end, 1, batch, loop.time()), 5)
    feed.caught_up.set()
    feed._catching_up = True
    await asyncio.wait_for(feed._linger(at_end, 1, batch, loop.time()), 5)
    feed._catching_up = False
    # Caught up, read to the end, a small batch: it lingers until the linger is shortened.
    waiting = asyncio.ensure_future(feed._linger(at_end, 1, batch, loop.time()))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not waiting.done()
    feed.set_linger(0, 100)  # taking the lead: shorter, so the current wait ends now
    await asyncio.wait_for(waiting, 5)


async def test_a_longer_linger_does_not_cut_the_current_one() -> None:
    feed = feed_with((250, 250))
    old_cut = feed._cut
    feed.set_linger(250, 500)  # standing by again: the same or longer
    assert feed._cut is old_cut and not old_cut.is_set()
    feed.set_linger(0, 100)
    assert old_cut.is_set() and feed._cut is not old_cut
    assert feed._lingers == [0.0, 0.1]


async def test_a_batch_reaches_its_step_without_a_trip_to_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FastDepends runs a plain-function dependency (the `KafkaMessage` parameter's) in a
    worker thread; the pipeline's batch handler asks for none, so a batch never leaves the
    event loop on its way to the step."""
    hops: list[Any] = []
    real = anyio.to_thread.run_sync

    async def spy(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(func)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", spy)
    broker = make_broker(ServiceSettings(), "hop-test")
    consumers = Consumers(broker, ServiceSettings(), service="hop-test")
    seen: list[bytes] = []

    async def step(records: Records) -> None:
        seen.extend(r.value for r in records)

    consumers.subscribe("hop-topic", group_id="hop-g", handle=step)
    async with TestKafkaBroker(broker) as test_broker:
        await test_broker.publish(b"one", "hop-topic")
        await test_broker.publish(b"two", "hop-topic")
    assert seen == [b"one", b"two"]
    assert hops == []


async def test_a_take_over_cuts_the_linger_and_reads_to_the_end_at_once() -> None:
    feed = feed_with((0, 60_000))
    at_end = FakeConsumer({TP: 5})
    batch: dict[TopicPartition, list[Any]] = {TP: [Record(3), Record(4)]}
    loop = asyncio.get_running_loop()
    waiting = asyncio.ensure_future(feed._linger(at_end, 1, batch, loop.time()))
    await asyncio.sleep(0)
    assert not waiting.done()
    await asyncio.wait_for(feed.catch_up(), 5)  # no consumers: nothing to read
    await asyncio.wait_for(waiting, 5)
    assert not feed._catching_up
