"""Who decides. Every scheduler replica follows the log; the one holding the lease runs the
cycle. Standing by (no lease, or Redis away) -> taking over (fence every partition decided on,
read up to the fences) -> leading (renew, cycle, wait for work) -> standing by when the lease
is lost or a newer leader's fence is read.

No failure ends the loop: a cycle that raises is logged (with its traceback when it is not a
dependency being away) and decided again after a backoff, once the log has been read back;
Redis away means standing by, logged once per outage, and taking over afresh when it answers."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from faststream.kafka import KafkaBroker
from redis.exceptions import RedisError

from schemas.topics import FENCED_TOPICS
from services.common.errors import Failure, classify, describe
from services.common.kafka import publish_all
from services.scheduler.handlers import SchedulerMetrics, fence_messages
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import SchedulerState

log = structlog.get_logger()
# A new leader that has not read its own fences by then gives the lease up and tries again.
TAKE_OVER_TIMEOUT_S = 60.0
# After a failed cycle, reading the log back to its end may take this long before it counts as
# another failure (the lease is renewed meanwhile).
READ_BACK_TIMEOUT_S = 30.0


class Lease(Protocol):
    epoch: int | None

    @property
    def held(self) -> bool: ...
    async def try_acquire(self, floor: int = 0) -> bool: ...
    async def renew(self) -> bool: ...
    async def release(self) -> None: ...


class Log(Protocol):
    """The feed, as the leader uses it."""

    caught_up: asyncio.Event
    records: int

    def partitions_of(self, topics: tuple[str, ...]) -> list[tuple[str, int]]: ...
    async def catch_up(self, poll_s: float = 0.01) -> None: ...
    def set_fetch_wait(self, ms: int, cold_ms: int | None = None) -> None: ...
    def set_linger(self, ms: int, cold_ms: int | None = None) -> None: ...


class Decider(Protocol):
    async def run_once(
        self,
        epoch: int,
        now: float | None = None,
        still_leading: Callable[[], Awaitable[bool]] | None = None,
    ) -> int: ...

    def explanation_due(self, now: float) -> bool: ...


@dataclass
class Backoff:
    """Pauses that double with each failure in a row, up to `max_s`, with jitter."""

    base_s: float = 0.1
    max_s: float = 5.0
    rng: random.Random = field(default_factory=random.Random)

    def pause(self, failures: int) -> float:
        return min(self.max_s, self.base_s * 2.0 ** max(0, failures - 1)) * self.rng.uniform(0.5, 1)


class Leadership:
    def __init__(
        self,
        *,
        state: SchedulerState,
        feed: Log,
        cycle: Decider,
        lease: Lease,
        broker: KafkaBroker,
        metrics: SchedulerMetrics,
        settings: SchedulerSettings,
        holder: str,
        backoff: Backoff | None = None,
    ) -> None:
        self.state = state
        self.feed = feed
        self.cycle = cycle
        self.lease = lease
        self.broker = broker
        self.metrics = metrics
        self.settings = settings
        self.holder = holder
        self.backoff = backoff or Backoff()
        # Set by the feed when something worth a cycle happened.
        self.wake = asyncio.Event()
        self.renew_every = settings.lease_ttl_ms / 3000
        self.last_renew = 0.0
        self.last_cycle = 0.0
        self.failures = 0  # cycles (or take-overs) failed in a row
        self.outage = 0  # lease calls failed in a row: Redis away
        # A cycle failed: part of its publish may be in the log all the same (an acknowledgement
        # lost after the write). The log is read back to its end before deciding again, so a
        # job whose placement did go out is not placed a second time.
        self.unsettled = False

    async def run(self) -> None:
        await self.feed.caught_up.wait()
        if self.lease.held:  # restarted after a crash: take over afresh, fences and all
            with contextlib.suppress(RedisError):
                await self.lease.release()
            self.lease.epoch = None
        while True:
            try:  # the outer try: Redis can fail inside the inner handler too (renewing)
                try:
                    await self.step()
                except RedisError:
                    raise
                except Exception as exc:  # a bug outside the cycle: never the end of the loop
                    await self._failed(exc, "leader step")
            except RedisError as exc:
                await self._redis_away(exc)

    async def step(self) -> None:
        """One turn: stand by, take over, or lead one cycle and wait for more work."""
        lease, state = self.lease, self.state
        if lease.held and state.newest_epoch() > (lease.epoch or 0):
            log.warning("a newer leader has fenced us; standing by", epoch=lease.epoch)
            await lease.release()
        if not lease.held:
            self.metrics.leader.set(0)
            self.metrics.forget_figures()
            self.feed.set_fetch_wait(self.settings.standby_fetch_max_wait_ms)
            self.feed.set_linger(self.settings.standby_linger_ms)
            acquired = await lease.try_acquire(floor=state.newest_epoch())
            self._redis_answers()
            if not acquired:
                await asyncio.sleep(self.renew_every)
                return
            self.feed.set_fetch_wait(
                self.settings.fetch_max_wait_ms, self.settings.cold_fetch_max_wait_ms
            )
            self.feed.set_linger(0, self.settings.cold_linger_ms)
            if not await self._take_over():
                return
        elif self._renewal_due() and not await self.still_leading():
            log.warning("lost the lease; standing by")
            return
        self.metrics.leader.set(1)
        if state.wake_due(time.time()):
            state.dirty = True  # a backoff or a protection ran out
        now = time.monotonic()
        due = state.dirty or self.cycle.explanation_due(time.time())
        if due or now - self.last_cycle >= self.settings.idle_cycle_s:
            if not await self._cycle():
                return
            self.last_cycle = now
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), self.settings.cycle_interval_s)
        self.wake.clear()
        await asyncio.sleep(self.settings.min_cycle_gap_s)

    def _renewal_due(self) -> bool:
        return time.monotonic() - self.last_renew >= self.renew_every

    async def still_leading(self) -> bool:
        renewed = await self.lease.renew()
        self._redis_answers()
        if not renewed:
            return False
        self.last_renew = time.monotonic()
        return True

    async def _take_over(self) -> bool:
        """Fence the topics we decide on, then read everything before the fences (and to the
        end of the others): a deposed leader still publishing cannot slip a decision past us,
        because what it wrote before a fence we read now and what it writes after one is
        refused downstream (LeaderFence). False if the lease was lost or the broker failed."""
        epoch = self.lease.epoch
        assert epoch is not None
        try:
            taken = await self._while_renewing(self._fence_and_read(epoch), TAKE_OVER_TIMEOUT_S)
        except RedisError:
            raise
        except Exception as exc:
            # The broker is away, or our fences took too long to read: give the lease up
            # (a replica that reaches the broker may take it) and try again after a pause.
            self.failures += 1
            pause = self.backoff.pause(self.failures)
            log.warning(
                "could not take over; standing by",
                epoch=epoch,
                error=describe(exc),
                retry_in_s=round(pause, 2),
                **({} if classify(exc) is Failure.RETRYABLE else {"exc_info": exc}),
            )
            await self.lease.release()
            await asyncio.sleep(pause)
            return False
        if not taken or not await self.still_leading():
            log.warning("lost the lease while taking over; standing by", epoch=epoch)
            return False
        if self.state.newest_epoch() > epoch:  # a newer leader fenced us meanwhile
            return False
        log.info("became leader", epoch=epoch, records=self.feed.records)
        self.state.dirty = True
        self.unsettled = False  # the log was just read to its end
        return True

    async def _fence_and_read(self, epoch: int) -> None:
        fenced = self.feed.partitions_of(FENCED_TOPICS)
        await publish_all(self.broker, fence_messages(epoch, self.holder, fenced))
        await self.feed.catch_up()
        while not self.state.fenced(fenced, epoch):  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    async def _cycle(self) -> bool:
        """One cycle, after reading the log back if the last one failed. False if it failed
        (logged, backed off) or the lease was lost; Redis errors go up (standing by)."""
        epoch = self.lease.epoch
        assert epoch is not None
        try:
            if self.unsettled:
                if not await self._while_renewing(self.feed.catch_up(), READ_BACK_TIMEOUT_S):
                    return False
                self.unsettled = False
            await self.cycle.run_once(epoch, still_leading=self.still_leading)
        except RedisError:
            raise
        except Exception as exc:
            await self._failed(exc, "cycle")
            return False
        self.failures = 0
        return True

    async def _failed(self, exc: Exception, what: str) -> None:
        """Log a failure, then back off while keeping the lease. A dependency away (broker,
        Redis) is one line after the first traceback of a streak; anything else, a bug the
        state or the core provokes, is logged with its traceback every time."""
        self.failures += 1
        self.unsettled = True
        self.state.dirty = True  # decide again, whatever happened
        self.metrics.cycle_failures.labels(type(exc).__name__).inc()
        pause = self.backoff.pause(self.failures)
        fields: dict[str, object] = {
            "error": describe(exc),
            "retry_in_s": round(pause, 2),
            "failures": self.failures,
        }
        if classify(exc) is Failure.RETRYABLE:  # the broker or Redis is away
            if self.failures == 1:
                fields["exc_info"] = exc
            log.warning(f"{what} failed; deciding again after a pause", **fields)
        else:
            log.error(f"{what} raised; deciding again after a pause", exc_info=exc, **fields)
        await self._pause(pause)

    async def _pause(self, seconds: float) -> None:
        """Sleep, renewing the lease meanwhile: a leader that backs off stays the leader (a
        backoff longer than the lease would otherwise hand it over, with new fences, each
        time the broker is slow)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, self.renew_every))
            if self.lease.held and self._renewal_due() and not await self.still_leading():
                return

    async def _while_renewing(self, work: Awaitable[None], timeout_s: float) -> bool:
        """Run `work`, renewing the lease meanwhile; False (work cancelled) if it is lost."""
        task = asyncio.ensure_future(work)
        try:
            async with asyncio.timeout(timeout_s):
                while not task.done():
                    await asyncio.wait({task}, timeout=self.renew_every)
                    if not task.done() and not await self.still_leading():
                        return False
            task.result()
            return True
        finally:
            task.cancel()

    def _redis_answers(self) -> None:
        if self.outage:
            log.info("Redis answers again", failed_tries=self.outage)
            self.outage = 0

    async def _redis_away(self, exc: RedisError) -> None:
        """Nobody can renew or take the lease while Redis is away: decide nothing (ours lapses
        by itself), stand by, and try again with backoff; one warning per outage."""
        self.lease.epoch = None
        self.metrics.leader.set(0)
        self.metrics.forget_figures()
        self.outage += 1
        if self.outage == 1:
            self.metrics.redis_outages.inc()
            log.warning("Redis is unreachable; standing by", error=describe(exc))
        await asyncio.sleep(self.backoff.pause(self.outage))
