"""The meter service: turns lifecycle events into usage ticks, keeps the ledger and budgets.

Run one replica: the clock bills every open run, so two replicas would each bill them (the
ledger's unique key keeps the totals right, but the work is done twice).
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from services.common.consumer import Consumers, Records
from services.common.db import create_pool
from services.common.housekeeping import start_housekeeping
from services.common.kafka import make_broker
from services.common.outbox import OutboxRelay
from services.common.policyfile import load_policy, read_yaml
from services.common.runtime import Runtime, create_http_app
from services.common.singleton import singleton_for
from services.meter import store
from services.meter.budgets import parse_config
from services.meter.handlers import Meter, MeterMetrics
from services.meter.intake import TOPICS
from services.meter.pricing import price_book
from services.meter.publisher import BatchPublisher, relay_producer
from services.meter.settings import MeterSettings
from services.meter.ticks import Grid

NAME = "meter"


def create_app(settings: MeterSettings | None = None) -> FastAPI:
    settings = settings or MeterSettings()
    runtime = Runtime(NAME, settings)
    # One instance at a time (docs/decisions.md); a second one stands by.
    runtime.singleton = singleton_for(settings.redis_url, NAME, settings.singleton_ttl_s)
    # The broker only consumes: ticks go out through the relay's own producer (publisher.py).
    broker = make_broker(settings, NAME, runtime.registry)
    policy = load_policy(settings.policy_file)
    book = price_book(read_yaml(settings.fleet_file), policy)
    config = parse_config(read_yaml(settings.budgets_file))
    grid = Grid.of(settings.meter_interval_s, settings.time_scale)
    metrics = MeterMetrics(runtime.registry)
    state: dict[str, Meter] = {}
    consumers = Consumers(broker, settings, service=NAME, registry=runtime.registry)

    async def handle(records: Records) -> None:
        await state["meter"].process(records, full=settings.max_batch_records)

    consumers.subscribe(*TOPICS, group_id=settings.group_id, handle=handle)

    async def clock() -> None:
        meter = state["meter"]
        # Bill by the clock only once the backlog is in: a run that ended while the meter was
        # down should be closed by its end event, not billed on and credited back.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(meter.caught_up.wait(), settings.meter_startup_grace_s)
        while True:
            if not await meter.tick():
                await asyncio.sleep(settings.meter_tick_period_s)

    @runtime.on_startup
    async def start() -> None:
        pool = await create_pool(settings.database_url, settings.db_pool_size)
        await store.migrate_meter(pool)
        producer = relay_producer(settings.kafka_bootstrap, f"{NAME}-relay")
        await producer.start()
        relay = OutboxRelay(pool, BatchPublisher(producer), store.SCHEMA)  # type: ignore[arg-type]
        await relay.flush()  # anything a crash left behind goes out before new work
        meter = Meter(
            pool,
            relay,
            grid,
            config,
            book,
            metrics,
            lag_s=settings.meter_lag_s,
            idle_lag_s=settings.meter_idle_lag_s,
            max_ticks_per_pass=settings.meter_max_ticks_per_pass,
            max_idle_backfill=settings.meter_max_idle_backfill,
        )
        await meter.restore()
        state["meter"] = meter
        runtime.background(relay.run_forever)
        consumers.probe = lambda: pool.fetchval("SELECT 1")
        runtime.background(consumers.committer.run_forever)
        runtime.background(clock)
        start_housekeeping(runtime, pool, store.SCHEMA)
        await consumers.start()

        async def close() -> None:
            await consumers.committer.flush()
            await broker.stop()
            await producer.stop()
            await pool.close()

        runtime.on_shutdown(close)

    app = create_http_app(runtime)
    app.state.runtime = runtime
    return app
