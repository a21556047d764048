"""The autoscaler service: reads the leading scheduler's demand, each cluster's elastic pools
and spent budgets from the log, and sends `autoscale.decided` (a pool's size and the empty
nodes to remove) for the executors to carry out; one `alert.raised` per pool whose
provisioning fails. The decision is `core.autoscale.decide` (planner.py).

It runs as a single instance (a Redis lease, like the health service): two would decide the
same pools. Decisions are sizes, so one sent twice (a restart, a redelivery) buys nothing twice.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ValidationError

from core.fleet import load_pools
from schemas import topics
from schemas.events import CapacityDemand, ClusterCapacity
from schemas.health import AlertRaised, Severity
from schemas.ids import new_id
from schemas.usage import BudgetExceeded
from schemas.validation import describe_validation_error
from services.autoscaler.planner import Incident, MonthlySpend, Plan, Planner
from services.autoscaler.settings import AutoscalerSettings
from services.common.bootstrap import open_outboxed
from services.common.consumer import Consumers, Records
from services.common.deadletter import dead_letter, decode_envelopes
from services.common.kafka import OutMessage, envelope_for, make_broker
from services.common.outbox import OutboxRelay
from services.common.policyfile import load_policy, read_yaml
from services.common.runtime import Runtime, create_http_app
from services.common.singleton import singleton_for

NAME = "autoscaler"
MIGRATIONS = Path(__file__).parent / "migrations"
log = structlog.get_logger()

PAYLOADS: dict[str, type[BaseModel]] = {
    topics.CAPACITY_DEMAND: CapacityDemand,
    topics.CLUSTER_CAPACITY: ClusterCapacity,
    topics.BUDGET_EXCEEDED: BudgetExceeded,
}


class AutoscalerMetrics:
    def __init__(self, registry: Any) -> None:
        self.decisions = Counter(
            "qm_autoscaler_decisions", "Pool sizes sent", ["pool"], registry=registry
        )
        self.nodes_removed = Counter(
            "qm_autoscaler_nodes_removed", "Empty nodes sent away", ["pool"], registry=registry
        )
        self.provisioning_failures = Counter(
            "qm_autoscaler_provisioning_failures",
            "Pools whose provisioning started failing (incidents)",
            ["pool"],
            registry=registry,
        )
        self.scale_up = Histogram(
            "qm_autoscaler_scale_up_seconds",
            "From a pool node's request until it is ready (wall seconds)",
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600),
            registry=registry,
        )
        self.idle_node_hours = Counter(
            "qm_autoscaler_idle_node_hours",
            "Hours pool nodes sat ready and empty (paid for, unused)",
            registry=registry,
        )
        self.unserved = Gauge(
            "qm_autoscaler_unserved_jobs",
            "Jobs waiting for capacity that no pool was grown for",
            registry=registry,
        )
        self.spend_rate = Gauge(
            "qm_autoscaler_spend_per_hour",
            "What the elastic pools' nodes (ready and provisioning) cost per hour",
            registry=registry,
        )
        self.spent_this_month = Gauge(
            "qm_autoscaler_cloud_spend_this_month",
            "What the elastic pools cost this month (fleet time), against the cloud budget",
            registry=registry,
        )


def utcnow() -> datetime:
    return datetime.now(UTC)


def create_app(settings: AutoscalerSettings | None = None) -> FastAPI:
    settings = settings or AutoscalerSettings()
    runtime = Runtime(NAME, settings)
    runtime.singleton = singleton_for(settings.redis_url, NAME, settings.singleton_ttl_s)
    broker = make_broker(settings, NAME, runtime.registry)
    policy = load_policy(settings.policy_file)
    pools = [
        p
        for cluster_pools in load_pools(
            read_yaml(settings.fleet_file), policy.accelerator_types, policy.prices
        ).values()
        for p in cluster_pools
    ]
    metrics = AutoscalerMetrics(runtime.registry)
    state: dict[str, Any] = {}
    consumers = Consumers(broker, settings, service=NAME, registry=runtime.registry)

    async def handle(records: Records) -> None:
        planner: Planner = state["planner"]
        decoded, dead = decode_envelopes(records, consumer=NAME, models=PAYLOADS)
        blocks: list[tuple[str, str]] = []
        for got in decoded:
            try:
                payload = PAYLOADS[got.record.topic].model_validate(got.envelope.payload)
            except ValidationError as error:
                message = describe_validation_error(error)
                dead.append(dead_letter(got.record, message, consumer=NAME))
                continue
            at = got.envelope.occurred_at
            if isinstance(payload, CapacityDemand):
                planner.on_demand(payload, at)
            elif isinstance(payload, ClusterCapacity):
                seen = planner.on_capacity(payload, at)
                for seconds in seen.ready_after_s:
                    metrics.scale_up.observe(seconds)
                metrics.idle_node_hours.inc(seen.idle_node_s / 3600.0)
            elif isinstance(payload, BudgetExceeded) and planner.on_budget(payload):
                blocks.append((payload.tenant, payload.month))
        if blocks:
            await state["pool"].executemany(
                "INSERT INTO autoscaler.budget_blocks (tenant, month) VALUES ($1, $2)"
                " ON CONFLICT DO NOTHING",
                blocks,
            )
        if dead:
            relay: OutboxRelay = state["relay"]
            async with relay.transaction() as tx:
                tx.emit(dead)

    consumers.subscribe(*PAYLOADS, group_id=settings.group_id, handle=handle)

    async def decide_loop() -> None:
        while True:
            await asyncio.sleep(settings.decide_every_s)
            try:
                await decide_once()
            except Exception as error:  # the store may be away: the next round tries again
                log.warning("autoscale round failed", error=str(error))

    async def decide_once() -> None:
        singleton = runtime.singleton
        if singleton is not None and not singleton.holds():
            return  # frozen past the lease: a successor may be deciding
        planner: Planner = state["planner"]
        plan = planner.plan(utcnow())
        metrics.unserved.set(len(plan.unserved))
        metrics.spend_rate.set(planner.spend_rate())
        spend = planner.spend
        if spend is not None and spend.at is not None:
            metrics.spent_this_month.set(spend.spent)
        out = _messages(plan)
        if not out and not plan.closed:
            if spend is not None and spend.at is not None:
                await _save_spend(state["pool"], spend)
            return
        relay: OutboxRelay = state["relay"]
        async with relay.transaction() as tx:
            tx.emit(out)
            if spend is not None and spend.at is not None:
                await _save_spend(tx.conn, spend)
            await tx.conn.executemany(
                "INSERT INTO autoscaler.pool_incidents (pool, cluster, cause, since)"
                " VALUES ($1, $2, $3, $4) ON CONFLICT (pool) DO NOTHING",
                [(i.pool, i.cluster, i.cause, i.since) for i in plan.incidents],
            )
            if plan.closed:
                await tx.conn.execute(
                    "DELETE FROM autoscaler.pool_incidents WHERE pool = ANY($1::text[])",
                    plan.closed,
                )
        for d in plan.decisions:
            metrics.decisions.labels(d.pool).inc()
            metrics.nodes_removed.labels(d.pool).inc(len(d.remove))
            log.info(
                "pool size decided",
                pool=d.pool,
                cluster=d.cluster,
                desired=d.desired_nodes,
                remove=d.remove,
                for_jobs=len(d.for_jobs),
                reason=d.reason,
            )
        for incident in plan.incidents:
            metrics.provisioning_failures.labels(incident.pool).inc()
            log.warning("pool provisioning failing", pool=incident.pool, cause=incident.cause)

    @runtime.on_startup
    async def start() -> None:
        schema = NAME
        pool, relay = await open_outboxed(
            runtime, broker, consumers, schema=schema, migrations=MIGRATIONS
        )
        state["relay"] = relay
        state["pool"] = pool
        planner = Planner(
            pools,
            time_scale=settings.time_scale,
            started_at=utcnow(),
            spot_for_preemptible_only=policy.placement.spot_for_preemptible_only,
            resend_after_s=settings.resend_after_s,
            demand_stale_s=settings.demand_stale_s,
            failing_pause_s=settings.failing_pause_s,
            cloud_budget_per_month=settings.cloud_budget_per_month,
        )
        month = utcnow().strftime("%Y-%m")
        if planner.spend is not None:
            row = await pool.fetchrow(
                "SELECT * FROM autoscaler.monthly_spend ORDER BY at DESC LIMIT 1"
            )
            if row is not None:
                planner.spend.month, planner.spend.spent = row["month"], row["spent"]
                planner.spend.rate, planner.spend.at = row["rate"], row["at"]
        rows = await pool.fetch(
            "SELECT tenant, month FROM autoscaler.budget_blocks WHERE month >= $1", month
        )
        planner.blocked |= {(r["tenant"], r["month"]) for r in rows}
        for r in await pool.fetch("SELECT * FROM autoscaler.pool_incidents"):
            planner.failing[r["pool"]] = Incident(r["pool"], r["cluster"], r["cause"], r["since"])
        state["planner"] = planner
        runtime.background(decide_loop)
        await consumers.start()
        log.info("autoscaler started", pools=[p.name for p in pools])

    app = create_http_app(runtime)
    app.state.runtime = runtime
    app.state.autoscaler = state
    return app


def _messages(plan: Plan) -> list[OutMessage]:
    out = [
        OutMessage(
            topics.AUTOSCALE_DECIDED,
            d.cluster,
            envelope_for("AutoscaleDecided", d, producer=NAME),
        )
        for d in plan.decisions
    ]
    for incident in plan.incidents:
        alert = AlertRaised(
            alert_id=new_id(),
            severity=Severity.WARNING,
            subject=incident.pool,
            cluster=incident.cluster,
            cause=incident.cause,
            suggested_action=(
                "demand goes to the next cheapest pool meanwhile; check the provider's "
                "capacity or quota for this pool, or lower its max_nodes"
            ),
            first_seen=incident.since,
            count=1,
        )
        out.append(
            OutMessage(
                topics.ALERT_RAISED,
                incident.pool,
                envelope_for("AlertRaised", alert, producer=NAME),
            )
        )
    return out


async def _save_spend(conn: Any, spend: MonthlySpend) -> None:
    await conn.execute(
        "INSERT INTO autoscaler.monthly_spend (month, spent, rate, at) VALUES ($1, $2, $3, $4)"
        " ON CONFLICT (month) DO UPDATE SET spent = EXCLUDED.spent, rate = EXCLUDED.rate,"
        " at = EXCLUDED.at",
        spend.month,
        spend.spent,
        spend.rate,
        spend.at,
    )
