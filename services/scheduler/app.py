"""The scheduler service: every replica follows the log; the one holding the lease decides."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from typing import Any

import structlog
from fastapi import FastAPI
from redis.asyncio import Redis

from services.common.kafka import make_broker
from services.common.lease import RedisLease
from services.common.policyfile import load_policy
from services.common.runtime import Runtime, create_http_app
from services.scheduler.feed import Feed
from services.scheduler.handlers import FEED_TOPICS, Cycle, SchedulerMetrics, apply_records
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import SchedulerState

NAME = "scheduler"
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

    async def lead() -> None:
        """Hold or wait for the lease; decide only while holding it and caught up."""
        await feed.caught_up.wait()
        renew_every = settings.lease_ttl_ms / 3000
        last_renew = 0.0
        last_cycle = 0.0
        while True:
            now = time.monotonic()
            if not lease.held:
                metrics.leader.set(0)
                if not await lease.try_acquire():
                    await asyncio.sleep(renew_every)
                    continue
                await feed.catch_up()
                log.info("became leader", epoch=lease.epoch)
                state.dirty = True
                last_renew = now
            elif now - last_renew >= renew_every:
                if not await lease.renew():
                    log.warning("lost the lease; standing by")
                    continue
                last_renew = now
            metrics.leader.set(1)
            if state.wake_due(time.time()):
                state.dirty = True  # a backoff or a protection ran out
            if state.dirty or now - last_cycle >= settings.idle_cycle_s:
                assert lease.epoch is not None
                await cycle.run_once(lease.epoch, still_leading=lease.renew)
                last_renew = time.monotonic()
                last_cycle = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), settings.cycle_interval_s)
            wake.clear()
            await asyncio.sleep(settings.min_cycle_gap_s)

    @runtime.on_startup
    async def start() -> None:
        await broker.connect()
        await feed.start()
        runtime.background(feed.run)
        runtime.background(lead)

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
