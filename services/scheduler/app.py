"""The scheduler service: every replica follows the log; the one holding the lease decides."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
from typing import Any

import structlog
from aiokafka.errors import KafkaError
from fastapi import FastAPI
from redis.asyncio import Redis
from redis.exceptions import RedisError

from schemas.topics import FENCED_TOPICS
from services.common.kafka import make_broker, publish_all
from services.common.lease import RedisLease
from services.common.policyfile import load_policy
from services.common.runtime import Runtime, create_http_app
from services.scheduler.feed import Feed
from services.scheduler.handlers import (
    FEED_TOPICS,
    Cycle,
    SchedulerMetrics,
    apply_records,
    fence_messages,
)
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import SchedulerState

NAME = "scheduler"
# A new leader that has not read its own fences by then gives the lease up and tries again.
TAKE_OVER_TIMEOUT_S = 60.0
# Longest pause between tries when the broker or Redis is away.
BACKOFF_MAX_S = 5.0
log = structlog.get_logger()


def create_app(settings: SchedulerSettings | None = None) -> FastAPI:
    settings = settings or SchedulerSettings()
    runtime = Runtime(NAME, settings)
    broker = make_broker(settings, NAME, runtime.registry)
    policy = load_policy(settings.policy_file)
    metrics = SchedulerMetrics(runtime.registry)
    state = SchedulerState(time_scale=settings.time_scale)
    holder = f"{socket.gethostname()}:{os.getpid()}"
    wake = asyncio.Event()

    def on_records(records: list[Any]) -> None:
        apply_records(state, records, metrics)
        if state.dirty:
            wake.set()

    feed = Feed(settings.kafka_bootstrap, FEED_TOPICS, settings.fetch_max_wait_ms, on_records)
    cycle = Cycle(state, policy, broker, metrics, holder, settings.seed, settings.time_scale)
    redis = Redis.from_url(settings.redis_url)
    lease = RedisLease(redis, settings.lease_name, holder, settings.lease_ttl_ms)

    async def take_over(epoch: int) -> bool:
        """Fence the topics we decide on, then read everything before the fences (and to the
        end of the others): a deposed leader still publishing cannot slip a decision past us,
        because what it wrote before a fence we read now and what it writes after one is
        refused downstream (LeaderFence). The lease is renewed meanwhile; False if it is lost."""
        fenced = feed.partitions_of(FENCED_TOPICS)

        async def fence_and_read() -> None:
            await publish_all(broker, fence_messages(epoch, holder, fenced))
            await feed.catch_up()
            while not state.fenced(fenced, epoch):  # noqa: ASYNC110
                await asyncio.sleep(0.01)

        work = asyncio.create_task(fence_and_read())
        try:
            async with asyncio.timeout(TAKE_OVER_TIMEOUT_S):
                while not work.done():
                    await asyncio.wait({work}, timeout=settings.lease_ttl_ms / 3000)
                    if not work.done() and not await lease.renew():
                        return False
            work.result()
            return True
        finally:
            work.cancel()

    async def lead() -> None:
        """Hold or wait for the lease; decide only while holding it and caught up."""
        await feed.caught_up.wait()
        if lease.held:  # restarted after a crash: take over afresh, fences and all
            await lease.release()
        renew_every = settings.lease_ttl_ms / 3000
        last_renew = 0.0
        last_cycle = 0.0
        failures = 0

        async def still_leading() -> bool:
            nonlocal last_renew
            if not await lease.renew():
                return False
            last_renew = time.monotonic()
            return True

        while True:
            now = time.monotonic()
            if lease.held and state.newest_epoch() > (lease.epoch or 0):
                log.warning("a newer leader has fenced us; standing by", epoch=lease.epoch)
                await lease.release()
            if not lease.held:
                metrics.leader.set(0)
                if not await lease.try_acquire(floor=state.newest_epoch()):
                    await asyncio.sleep(renew_every)
                    continue
                epoch = lease.epoch
                assert epoch is not None
                try:
                    taken = await take_over(epoch)
                except BaseException:
                    await lease.release()
                    raise
                if not taken or not await still_leading():
                    log.warning("lost the lease while taking over; standing by", epoch=epoch)
                    continue
                if state.newest_epoch() > epoch:  # a newer leader fenced us meanwhile
                    continue
                log.info("became leader", epoch=epoch, records=feed.records)
                state.dirty = True
            elif now - last_renew >= renew_every and not await still_leading():
                log.warning("lost the lease; standing by")
                continue
            metrics.leader.set(1)
            if state.wake_due(time.time()):
                state.dirty = True  # a backoff or a protection ran out
            if state.dirty or now - last_cycle >= settings.idle_cycle_s:
                assert lease.epoch is not None
                try:
                    await cycle.run_once(lease.epoch, still_leading=still_leading)
                    failures = 0
                except (RedisError, KafkaError, OSError, TimeoutError) as exc:
                    # The broker or Redis is away: nothing of the cycle was applied (see
                    # Cycle.run_once). Back off, then decide again on what the feed has read.
                    failures += 1
                    pause = min(BACKOFF_MAX_S, 0.1 * 2**failures) * random.uniform(0.5, 1.0)
                    log.warning(
                        "cycle failed; deciding again",
                        error=f"{type(exc).__name__}: {exc}",
                        retry_in_s=round(pause, 2),
                        failures=failures,
                    )
                    await asyncio.sleep(pause)
                    continue
                last_cycle = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), settings.cycle_interval_s)
            wake.clear()
            await asyncio.sleep(settings.min_cycle_gap_s)

    async def lead_through_outages() -> None:
        """Lead; while Redis is away nobody can hold the lease, so stand by (logged once per
        outage) and back off instead of failing in a loop."""
        away = 0
        last_failure = 0.0
        while True:
            try:
                await lead()
                return
            except RedisError as exc:
                if time.monotonic() - last_failure > 30:
                    away = 0  # a new outage, not the same one going on
                last_failure = time.monotonic()
                if lease.held:
                    lease.epoch = None  # cannot renew: it lapses by itself; decide nothing
                metrics.leader.set(0)
                away += 1
                if away == 1:
                    log.warning("Redis is unreachable; standing by", error=str(exc))
                await asyncio.sleep(min(BACKOFF_MAX_S, 0.2 * 2**away) * random.uniform(0.5, 1))

    @runtime.on_startup
    async def start() -> None:
        await broker.connect()
        await feed.start()
        runtime.background(feed.run)
        runtime.background(lead_through_outages)

        async def close() -> None:
            await lease.release()
            await feed.stop()
            await broker.stop()
            await redis.aclose()

        runtime.on_shutdown(close)

    app = create_http_app(runtime)
    app.state.runtime = runtime
    app.state.scheduler = state
    return app
