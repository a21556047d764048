"""The health service: judges nodes from heartbeats, probes and inventories, and finds
stragglers in job progress reports; quarantines and recovers nodes with hysteresis; raises one
alert per incident.

It runs as a single instance: the silence check covers every node, so two replicas sharing
the heartbeat partitions would each declare the other's nodes dark. The same lease makes it
the one evaluator of the SLO file (services.health.slowatch), which raises one alert per
breach.
"""

from __future__ import annotations

import asyncio
import functools
from datetime import UTC, datetime

from fastapi import FastAPI
from prometheus_client import generate_latest

from schemas.ids import new_id
from services.common.bootstrap import open_outboxed
from services.common.catalogue import read_catalogue
from services.common.consumer import Consumers, Records
from services.common.kafka import make_broker
from services.common.policyfile import read_yaml
from services.common.runtime import Runtime, create_http_app
from services.common.scrape import parse_targets, scrape, scrape_client
from services.common.singleton import singleton_for
from services.health import store
from services.health.burn import CannotCover, max_points
from services.health.handlers import HealthMetrics, HealthMonitor
from services.health.intake import TOPICS
from services.health.rules import HealthRules
from services.health.settings import HealthSettings
from services.health.slofile import SloFile, SloFileError, catalogue_problems, parse_slo_file
from services.health.slowatch import SloMetrics, SloWatch

NAME = "health"


def load_rules(settings: HealthSettings) -> HealthRules:
    rules = HealthRules.from_dict(read_yaml(settings.health_file))
    return rules.with_timings(
        suspect_after_s=settings.suspect_after_s,
        unhealthy_after_s=settings.unhealthy_after_s,
        min_quarantine_s=settings.min_quarantine_s,
        clean_period_s=settings.clean_period_s,
    )


def load_slos(settings: HealthSettings) -> SloFile | None:
    """The SLO file, when there are targets to evaluate it on; checked against the metrics
    catalogue where docs/ is at hand (not in the container image)."""
    if not settings.metrics_targets.strip():
        return None
    try:
        slos = parse_slo_file(read_yaml(settings.slo_file))
    except SloFileError as exc:
        raise SloFileError(f"{settings.slo_file}: {exc}") from None
    catalogue = read_catalogue()
    problems = catalogue_problems(slos, catalogue) if catalogue is not None else []
    if problems:
        raise SloFileError(f"{settings.slo_file}: " + "; ".join(problems))
    try:  # refused at start, like a bad file: the longest window must fit in the history
        max_points(slos, settings.slo_eval_every_s)
    except CannotCover as exc:
        raise SloFileError(f"{settings.slo_file}: {exc}") from None
    return slos


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
    slos = load_slos(settings)
    slo_metrics = SloMetrics(runtime.registry)
    state: dict[str, HealthMonitor] = {}
    watch: dict[str, SloWatch] = {}
    consumers = Consumers(broker, settings, service=NAME, registry=runtime.registry)

    async def handle(records: Records) -> None:
        await state["monitor"].process(records)

    consumers.subscribe(*TOPICS, group_id=settings.group_id, handle=handle)

    async def check_loop() -> None:
        while True:
            await asyncio.sleep(settings.check_interval_s)
            await state["monitor"].check()

    async def slo_loop() -> None:
        while True:
            await asyncio.sleep(settings.slo_eval_every_s)
            await watch["slo"].evaluate()

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
        if slos is not None:
            client = scrape_client()  # kept: one TLS context, connections reused

            @runtime.on_shutdown
            async def close_client() -> None:
                await client.aclose()

            watch["slo"] = SloWatch(
                slos,
                parse_targets(settings.metrics_targets),
                pool,
                relay,
                slo_metrics,
                own=(NAME, lambda: generate_latest(runtime.registry).decode()),
                clock=utcnow,
                new_id=new_id,
                on_alerts=metrics.alerts.inc,
                every_s=settings.slo_eval_every_s,
                scraper=functools.partial(scrape, client=client),
            )
            await watch["slo"].load()
            runtime.background(slo_loop)
        await consumers.start()

    app = create_http_app(runtime)
    app.state.runtime = runtime
    app.state.broker = broker
    app.state.monitor = state
    app.state.slo_watch = watch
    return app
