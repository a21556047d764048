"""The health service: judges nodes from heartbeats, probes and inventories, and finds
stragglers in job progress reports; quarantines and recovers nodes with hysteresis; raises one
alert per incident.

It runs as a single instance: the silence check covers every node, so two replicas sharing
the heartbeat partitions would each declare the other's nodes dark.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from fastapi import FastAPI

from schemas.ids import new_id
from services.common.bootstrap import open_outboxed
from services.common.consumer import Consumers, Records
from services.common.kafka import make_broker
from services.common.policyfile import read_yaml
from services.common.runtime import Runtime, create_http_app
from services.common.singleton import singleton_for
from services.health import store
from services.health.handlers import HealthMetrics, HealthMonitor
from services.health.intake import TOPICS
from services.health.rules import HealthRules
from services.health.settings import HealthSettings

NAME = "health"


def load_rules(settings: HealthSettings) -> HealthRules:
    rules = HealthRules.from_dict(read_yaml(settings.health_file))
    return rules.with_timings(
        suspect_after_s=settings.suspect_after_s,
        unhealthy_after_s=settings.unhealthy_after_s,
        min_quarantine_s=settings.min_quarantine_s,
        clean_period_s=settings.clean_period_s,
    )


def utcnow() -> datetime:
    return datetime.now(UTC)


def create_app(settings: HealthSettings | None = None) -> FastAPI:
    settings = settings or HealthSettings()
    runtime = Runtime(NAME, settings)
    # One instance at a time (docs/decisions.md); a second one stands by.
    runtime.singleton = singleton_for(settings.redis_url, NAME, settings.singleton_ttl_s)
    broker = make_broker(settings, NAME, runtime.registry)
    rules = load_rules(settings)
    metrics = HealthMetrics(runtime.registry)
    state: dict[str, HealthMonitor] = {}
    consumers = Consumers(broker, settings, service=NAME, registry=runtime.registry)

    async def handle(records: Records) -> None:
        await state["monitor"].process(records)

    consumers.subscribe(*TOPICS, group_id=settings.group_id, handle=handle)

    async def check_loop() -> None:
        while True:
            await asyncio.sleep(settings.check_interval_s)
            await state["monitor"].check()

    @runtime.on_startup
    async def start() -> None:
        pool, relay = await open_outboxed(
            runtime, broker, consumers, schema=store.SCHEMA, migrations=store.MIGRATIONS
        )
        book = await store.load_book(pool)
        state["monitor"] = HealthMonitor(
            pool, relay, book, rules, metrics, clock=utcnow, new_id=new_id
        )
        runtime.background(check_loop)
        await broker.start()

    app = create_http_app(runtime)
    app.state.runtime = runtime
    app.state.broker = broker
    app.state.monitor = state
    return app
