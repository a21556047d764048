"""The scheduler service: every replica follows the log; the one holding the lease decides."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import structlog
from fastapi import FastAPI
from redis.asyncio import Redis

from services.common.consumer import ConsumerMetrics
from services.common.kafka import make_broker
from services.common.lease import RedisLease
from services.common.policyfile import load_policy
from services.common.runtime import Runtime, create_http_app
from services.scheduler.cycle import Cycle
from services.scheduler.feed import Feed
from services.scheduler.handlers import FEED_TOPICS, SchedulerMetrics, apply_records
from services.scheduler.leadership import Backoff, Leadership
from services.scheduler.persist import Snapshots
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import SchedulerState
from services.scheduler.traces import Waiting
from services.scheduler.working import WorkingSet

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
    redis = Redis.from_url(settings.redis_url)
    lease = RedisLease(redis, settings.lease_name, holder, settings.lease_ttl_ms)

    waiting = Waiting(runtime.tracing, state) if runtime.tracing is not None else None

    def on_records(records: list[Any]) -> None:
        if waiting is not None:
            waiting.note(records)
        apply_records(state, records, metrics)
        working.bound(state)
        if state.dirty:
            leadership.wake.set()

    feed = Feed(
        settings.kafka_bootstrap,
        FEED_TOPICS,
        settings.fetch_max_wait_ms,
        on_records,
        cold_fetch_max_wait_ms=settings.cold_fetch_max_wait_ms,
        metrics=ConsumerMetrics(runtime.registry),
        name=f"{NAME}-feed",
        idle_factor=settings.fetch_idle_factor,
        idle_max_ms=settings.fetch_idle_max_ms,
        quiet_s=settings.fetch_idle_after_s,
        wait_at_client=settings.fetch_wait_at == "client",
    )
    working = WorkingSet(verify_every=settings.working_set_check_every)
    cycle = Cycle(
        state, policy, broker, metrics, holder, settings.time_scale, working, waiting=waiting
    )
    leadership = Leadership(
        state=state,
        feed=feed,
        cycle=cycle,
        lease=lease,
        broker=broker,
        metrics=metrics,
        settings=settings,
        holder=holder,
        backoff=Backoff(),
    )

    snapshots = Snapshots(
        database_url=settings.database_url,
        name=settings.lease_name,
        bootstrap=settings.kafka_bootstrap,
        state=state,
        feed=feed,
        metrics=metrics,
        holder=holder,
        every_s=settings.snapshot_every_s,
        min_records=settings.snapshot_min_records,
        leading=lambda: lease.held,
        topics=FEED_TOPICS,
        replay_truncated=settings.replay_truncated_log,
    )

    @runtime.on_startup
    async def start() -> None:
        started = time.monotonic()
        await broker.connect()
        resume = await snapshots.load() if settings.snapshots else None
        await feed.start(resume)
        runtime.background(feed.run)

        async def ready() -> None:
            await feed.caught_up.wait()
            metrics.caught_up.set(1)
            metrics.start_seconds.set(time.monotonic() - started)
            metrics.start_records.set(feed.records)
            log.info(
                "caught up",
                seconds=round(time.monotonic() - started, 3),
                records=feed.records,
                resumed=resume is not None,
            )

        runtime.background(ready)
        if settings.snapshots:
            runtime.background(snapshots.run)

        async def lead() -> None:
            await leadership.run()

        runtime.background(lead)

        async def close() -> None:
            await lease.release()
            await feed.stop()
            await snapshots.close()
            await broker.stop()
            await redis.aclose()

        runtime.on_shutdown(close)

    app = create_http_app(runtime)
    app.state.runtime = runtime
    app.state.scheduler = state
    app.state.snapshots = snapshots
    return app
