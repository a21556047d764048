"""The scheduler's leader loop never dies and never spins: a cycle that raises is logged (with
its traceback), the log is read back, and the cycle runs again after a growing pause, the
lease held all along; Redis away means standing by, one warning per outage, and taking over
afresh once it answers; a take-over the broker fails gives the lease up and tries again."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError
from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError
from structlog.testing import capture_logs

from schemas import topics
from services.scheduler.errors import PublishFailed
from services.scheduler.handlers import SchedulerMetrics
from services.scheduler.leadership import Backoff, Leadership
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import SchedulerState

LEASE_TTL_MS = 60  # renewed every 20 ms
BACKOFF = Backoff(base_s=0.01, max_s=0.08, rng=random.Random(1))


class FakeLease:
    """RedisLease in memory; while Redis is `down_for` a while, every call raises as it does."""

    def __init__(self, journal: list[str]) -> None:
        self.epoch: int | None = None
        self.counter = 0
        self.down_until = 0.0
        self.calls: list[str] = []
        self.failed = 0
        self.journal = journal

    @property
    def held(self) -> bool:
        return self.epoch is not None

    def down_for(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds

    def _call(self, name: str) -> None:
        self.calls.append(name)
        self.journal.append(name)
        if time.monotonic() < self.down_until:
            self.failed += 1
            raise RedisConnectionError("Error 111 connecting to localhost:6379")

    async def try_acquire(self, floor: int = 0) -> bool:
        self._call("acquire")
        self.counter = max(self.counter, floor) + 1
        self.epoch = self.counter
        return True

    async def renew(self) -> bool:
        self._call("renew")
        return self.held

    async def release(self) -> None:
        self._call("release")
        self.epoch = None


class FakeFeed:
    def __init__(self, journal: list[str]) -> None:
        self.caught_up = asyncio.Event()
        self.caught_up.set()
        self.records = 0
        self.journal = journal
        self.waits: list[int] = []  # fetch waits asked for, in order
        self.lingers: list[tuple[int, int | None]] = []  # lingers asked for, in order

    def partitions_of(self, names: tuple[str, ...]) -> list[tuple[str, int]]:
        return [(topics.PLACEMENT_DECIDED, 0)]

    async def catch_up(self, poll_s: float = 0.01) -> None:
        self.journal.append("read back")

    def set_fetch_wait(self, ms: int, cold_ms: int | None = None) -> None:
        self.waits.append(ms)

    def set_linger(self, ms: int, cold_ms: int | None = None) -> None:
        self.lingers.append((ms, cold_ms))


class FencingBroker:
    """Takes a leader's fence and shows it to the state, as the feed would; `away` fails the
    next publishes as a broker that does not answer."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.away = 0

    async def publish(self, body: bytes, topic: str, **kwargs: Any) -> None:
        if self.away:
            self.away -= 1
            raise KafkaTimeoutError()
        self.state.on_fence(topic, kwargs["partition"], json.loads(body)["payload"]["epoch"])


class ScriptedCycle:
    """Raises the scripted errors in turn, then succeeds; writes each try in the journal."""

    def __init__(self, journal: list[str], errors: list[Exception]) -> None:
        self.journal = journal
        self.errors = errors
        self.epochs: list[int] = []
        self.owed = False  # an explanation is owed (see Cycle.explanation_due)

    def explanation_due(self, now: float) -> bool:
        return self.owed

    async def run_once(
        self,
        epoch: int,
        now: float | None = None,
        still_leading: Callable[[], Awaitable[bool]] | None = None,
    ) -> int:
        self.owed = False
        self.epochs.append(epoch)
        self.journal.append("cycle")
        if still_leading is not None:
            await still_leading()
        if self.errors:
            raise self.errors.pop(0)
        return 0


class Rig:
    def __init__(self, errors: list[Exception]) -> None:
        self.journal: list[str] = []
        self.state = SchedulerState()
        self.lease = FakeLease(self.journal)
        self.broker = FencingBroker(self.state)
        self.cycle = ScriptedCycle(self.journal, errors)
        self.registry = CollectorRegistry()
        settings = SchedulerSettings(
            lease_ttl_ms=LEASE_TTL_MS, cycle_interval_s=0.005, min_cycle_gap_s=0.001
        )
        self.leadership = Leadership(
            state=self.state,
            feed=FakeFeed(self.journal),
            cycle=self.cycle,
            lease=self.lease,
            broker=self.broker,  # type: ignore[arg-type]
            metrics=SchedulerMetrics(self.registry),
            settings=settings,
            holder="test",
            backoff=BACKOFF,
        )

    async def until(self, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not done():  # noqa: ASYNC110
                await asyncio.sleep(0.005)

    def cycles(self) -> int:
        return self.journal.count("cycle")


@contextlib.asynccontextmanager
async def leading(rig: Rig) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(rig.leadership.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def events(logs: list[MutableMapping[str, Any]], text: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if text in e["event"]]


async def test_a_cycle_that_raises_is_logged_with_its_traceback_and_tried_again() -> None:
    rig = Rig([KeyError("j1"), KeyError("j1"), KeyError("j1")])
    with capture_logs() as logs:
        async with leading(rig) as task:
            await rig.until(lambda: rig.cycles() >= 5)
            assert not task.done()
    failed = events(logs, "cycle raised")
    assert len(failed) == 3
    assert all(e["log_level"] == "error" and isinstance(e["exc_info"], KeyError) for e in failed)
    pauses = [e["retry_in_s"] for e in failed]
    assert pauses[0] > 0 and pauses[2] > pauses[0]  # backs off, more each time
    # The lease was held throughout: one take-over, one epoch, no fences again.
    assert rig.lease.calls.count("acquire") == 1 and set(rig.cycle.epochs) == {1}
    assert (
        rig.registry.get_sample_value("qm_scheduler_cycle_failures_total", {"error": "KeyError"})
        == 3
    )


async def test_after_a_failed_publish_the_log_is_read_back_before_deciding_again() -> None:
    cause = KafkaTimeoutError()
    rig = Rig([PublishFailed(1, 2, cause), PublishFailed(1, 2, cause)])
    with capture_logs() as logs:
        async with leading(rig):
            await rig.until(lambda: rig.cycles() >= 4)
    tries = [j for j in rig.journal if j in ("cycle", "read back")]
    # The take-over reads the log; each failed cycle is followed by a read-back.
    assert tries[:6] == ["read back", "cycle", "read back", "cycle", "read back", "cycle"]
    failed = events(logs, "cycle failed")
    assert [e["log_level"] for e in failed] == ["warning", "warning"]
    # A dependency away: the traceback once per streak, then one line.
    assert "exc_info" in failed[0] and "exc_info" not in failed[1]


async def test_a_backoff_longer_than_the_lease_keeps_the_lease() -> None:
    rig = Rig([KafkaTimeoutError()])
    rig.leadership.backoff = Backoff(base_s=0.2, max_s=0.2, rng=random.Random(1))
    async with leading(rig):
        await rig.until(lambda: rig.cycles() >= 2)
    # The pause (at least 100 ms) outlasts the lease (60 ms): the leader renewed through it
    # and was never deposed, so it did not take over again with new fences.
    first, second = [i for i, j in enumerate(rig.journal) if j == "cycle"][:2]
    assert rig.journal[first:second].count("renew") >= 3
    assert rig.lease.calls.count("acquire") == 1 and rig.cycle.epochs[:2] == [1, 1]


async def test_redis_away_means_standing_by_warned_once_per_outage() -> None:
    rig = Rig([])
    rig.lease.down_for(0.3)
    with capture_logs() as logs:
        async with leading(rig):
            await rig.until(lambda: rig.cycles() >= 1)
            # Not a tight loop: a try per growing pause (10 ms doubling to 80 ms, jittered).
            assert 2 <= rig.lease.failed <= 15
            rig.lease.down_for(0.2)  # a second outage, while leading
            await rig.until(lambda: 2 in rig.cycle.epochs)
    assert len(events(logs, "Redis is unreachable")) == 2  # one per outage
    assert len(events(logs, "Redis answers again")) == 2
    assert rig.registry.get_sample_value("qm_scheduler_redis_outages_total") == 2
    # It stood by (its lease could not be renewed) and took over afresh: a new epoch.
    assert rig.cycle.epochs[0] == 1 and rig.cycle.epochs[-1] == 2


async def test_a_take_over_the_broker_fails_gives_the_lease_up_and_tries_again() -> None:
    rig = Rig([])
    rig.broker.away = 1
    with capture_logs() as logs:
        async with leading(rig):
            await rig.until(lambda: rig.cycles() >= 1)
    [failed] = events(logs, "could not take over")
    assert failed["retry_in_s"] > 0
    assert rig.lease.calls[:3] == ["acquire", "release", "acquire"]
    assert rig.cycle.epochs[0] == 2 and rig.state.fenced([(topics.PLACEMENT_DECIDED, 0)], 2)


@pytest.mark.parametrize("error", [RuntimeError("boom"), AssertionError()])
async def test_a_bug_outside_the_cycle_does_not_end_the_loop(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = Rig([])
    calls = {"n": 0}
    wake_due = rig.state.wake_due

    def broken_once(now: float) -> bool:
        calls["n"] += 1
        if calls["n"] == 1:
            raise error
        return wake_due(now)

    monkeypatch.setattr(rig.state, "wake_due", broken_once)
    with capture_logs() as logs:
        async with leading(rig) as task:
            await rig.until(lambda: rig.cycles() >= 1)
            assert not task.done()
    [failed] = events(logs, "leader step raised")
    assert failed["exc_info"] is error


async def test_redis_failing_while_a_failed_cycle_backs_off_means_standing_by() -> None:
    """The pause after a failed cycle renews the lease; Redis failing right then is an outage
    like any other, not the end of the loop."""
    rig = Rig([KeyError("j1")])
    rig.leadership.backoff = Backoff(base_s=0.1, max_s=0.1, rng=random.Random(1))
    run_once = rig.cycle.run_once

    async def redis_goes_with_the_cycle(epoch: int, **kwargs: Any) -> int:
        try:
            return await run_once(epoch, **kwargs)
        except KeyError:
            rig.lease.down_for(0.1)
            raise

    rig.cycle.run_once = redis_goes_with_the_cycle  # type: ignore[method-assign,assignment]
    with capture_logs() as logs:
        async with leading(rig) as task:
            await rig.until(lambda: 2 in rig.cycle.epochs)
            assert not task.done()
    assert len(events(logs, "cycle raised")) == 1
    assert len(events(logs, "Redis is unreachable")) == 1


async def test_redis_failing_while_a_failed_step_backs_off_means_standing_by(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = Rig([])
    rig.leadership.backoff = Backoff(base_s=0.1, max_s=0.1, rng=random.Random(1))
    wake_due = rig.state.wake_due

    def broken_once(now: float) -> bool:
        if rig.lease.counter == 1 and not rig.lease.down_until:
            rig.lease.down_for(0.1)
            raise RuntimeError("boom")
        return wake_due(now)

    monkeypatch.setattr(rig.state, "wake_due", broken_once)
    with capture_logs() as logs:
        async with leading(rig) as task:
            await rig.until(lambda: 2 in rig.cycle.epochs)
            assert not task.done()
    assert len(events(logs, "leader step raised")) == 1
    assert len(events(logs, "Redis is unreachable")) == 1


async def test_a_standby_polls_slowly_and_a_leader_fast() -> None:
    """Following the log to be ready is all a standby does: it polls the broker at the slow
    rate, and switches to the fast one as it takes over (before reading to the end)."""
    rig = Rig([])
    settings = rig.leadership.settings
    feed = rig.leadership.feed
    assert isinstance(feed, FakeFeed)
    waits = feed.waits

    async def refused(floor: int = 0) -> bool:
        rig.lease._call("acquire")
        return False

    rig.lease.try_acquire = refused  # type: ignore[method-assign]
    await rig.leadership.step()
    assert waits == [settings.standby_fetch_max_wait_ms]
    assert settings.standby_fetch_max_wait_ms > settings.fetch_max_wait_ms

    rig.lease.try_acquire = FakeLease.try_acquire.__get__(rig.lease)  # type: ignore[method-assign]
    async with leading(rig):
        await rig.until(lambda: rig.cycles() >= 1)
    assert waits[1:3] == [settings.standby_fetch_max_wait_ms, settings.fetch_max_wait_ms]
    assert waits[-1] == settings.fetch_max_wait_ms
    # Batches are gathered while standing by; a leader's new work never is.
    assert feed.lingers[0] == (settings.standby_linger_ms, None)
    assert feed.lingers[-1] == (0, settings.cold_linger_ms)


async def test_an_explanation_owed_is_reason_enough_for_a_cycle() -> None:
    """With thousands waiting a cycle may decide without explaining them (EXPLAIN_GAP_S in
    services/scheduler/cycle.py); once that is due the leader runs a cycle for it, though
    nothing changed and the idle cycle is seconds away."""
    rig = Rig([])
    await rig.leadership.step()  # takes over and decides (a new state is dirty)
    assert rig.cycles() == 1
    rig.state.dirty = False
    await rig.leadership.step()
    assert rig.cycles() == 1  # nothing changed, nothing owed
    rig.cycle.owed = True
    await rig.leadership.step()
    assert rig.cycles() == 2 and not rig.cycle.owed
