"""The serving service: keeps inference services running as declared. It reads declarations
and commands (`service.declared`, `service.command`), what replicas report (`service.load`:
ready and where, load and latency) and the lifecycle of its replica jobs; each round it scales
each service for its load, steps its rollout and replaces lost replicas (services/serving/
book.py, on `core.serving`), submitting replica jobs to `job.submitted` and stopping them with
`job.cancel.requested` like any client, and publishes each service's status and endpoints on
`service.status` when they change.

One instance works at a time (a Redis lease, like the autoscaler): two would start the same
replicas. Its books are in its own schema; what it sends goes through its outbox in the same
transaction as the books that say it was sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import structlog
from fastapi import FastAPI
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ValidationError

from schemas import topics
from schemas.events import JobCancelRequested, JobPreempted, JobRejected, RunFailed
from schemas.robots import DeploymentCommand, DeploymentDeclared, RobotInventory
from schemas.serving import ReplicaReported, ServiceCommand, ServiceDeclared
from schemas.validation import describe_validation_error
from services.common.bootstrap import open_outboxed
from services.common.consumer import Consumers, Records
from services.common.deadletter import dead_letter, decode_envelopes
from services.common.kafka import OutMessage, decode_key, envelope_for, make_broker
from services.common.outbox import OutboxRelay
from services.common.runtime import Runtime, create_http_app
from services.common.singleton import singleton_for
from services.serving import deployments
from services.serving.book import Book, Refused, ReplicaRecord, RoundOut, ServiceRecord
from services.serving.deployments import DeploymentRecord, Deployments, FleetRound
from services.serving.settings import ServingSettings

NAME = "serving"
MIGRATIONS = Path(__file__).parent / "migrations"
REPLICA_PREFIX = "svc-"
log = structlog.get_logger()

PAYLOADS: dict[str, type[BaseModel]] = {
    topics.SERVICE_DECLARED: ServiceDeclared,
    topics.SERVICE_COMMAND: ServiceCommand,
    topics.SERVICE_LOAD: ReplicaReported,
    topics.JOB_PREEMPTED: JobPreempted,
    topics.JOB_RUN_FAILED: RunFailed,
    topics.JOB_REJECTED: JobRejected,
    topics.JOB_CANCEL_REQUESTED: JobCancelRequested,
    topics.DEPLOYMENT_DECLARED: DeploymentDeclared,
    topics.DEPLOYMENT_COMMAND: DeploymentCommand,
    topics.ROBOT_INVENTORY: RobotInventory,
}
# The job topics it reads are the rare ones (failures, refusals, preemptions, cancels): a
# replica's start, readiness and liveness come from its executor on `service.load`, so the
# serving service does not read every job's `job.started` and `job.finished` (measured: that
# cost the spine about a tenth of its throughput, docs/serving.md).
JOB_TOPICS = frozenset(
    {
        topics.JOB_PREEMPTED,
        topics.JOB_RUN_FAILED,
        topics.JOB_REJECTED,
        topics.JOB_CANCEL_REQUESTED,
    }
)
# Declarations and commands are applied once (by event id); the rest are idempotent.
ONCE = frozenset(
    {
        topics.SERVICE_DECLARED,
        topics.SERVICE_COMMAND,
        topics.DEPLOYMENT_DECLARED,
        topics.DEPLOYMENT_COMMAND,
    }
)


class ServingMetrics:
    def __init__(self, registry: Any) -> None:
        self.services = Gauge(
            "qm_serving_services", "Inference services declared", registry=registry
        )
        self.replicas = Gauge(
            "qm_serving_replicas",
            "Replicas of every service, by state",
            ["state"],
            registry=registry,
        )
        self.started = Counter(
            "qm_serving_replicas_started", "Replica jobs submitted", registry=registry
        )
        self.stopped = Counter(
            "qm_serving_replicas_stopped", "Replica jobs stopped", registry=registry
        )
        self.changes = Counter(
            "qm_serving_changes",
            "Service changes (scaled, rollout steps ...)",
            ["change"],
            registry=registry,
        )
        self.refused = Counter(
            "qm_serving_refused", "Declarations and commands refused", registry=registry
        )


def create_app(settings: ServingSettings | None = None) -> FastAPI:
    settings = settings or ServingSettings()
    runtime = Runtime(NAME, settings)
    runtime.singleton = singleton_for(settings.redis_url, NAME, settings.singleton_ttl_s)
    broker = make_broker(settings, NAME, runtime.registry)
    metrics = ServingMetrics(runtime.registry)
    book = Book(settings.time_scale, settings.silent_after_s)
    fleets = Deployments(settings.time_scale)
    lock = asyncio.Lock()
    state: dict[str, Any] = {}
    consumers = Consumers(broker, settings, service=NAME, registry=runtime.registry)

    async def handle(records: Records) -> None:
        # Most lifecycle events are other jobs': skipped by key before they are decoded.
        mine = tuple(
            r
            for r in records
            if r.topic not in JOB_TOPICS or (decode_key(r) or "").startswith(REPLICA_PREFIX)
        )
        decoded, dead = decode_envelopes(mine, consumer=NAME, models=PAYLOADS)
        parsed: list[tuple[Any, BaseModel]] = []
        for got in decoded:
            try:
                parsed.append(
                    (got, PAYLOADS[got.record.topic].model_validate(got.envelope.payload))
                )
            except ValidationError as error:
                dead.append(
                    dead_letter(got.record, describe_validation_error(error), consumer=NAME)
                )
        relay: OutboxRelay = state["relay"]
        async with lock:
            await fresh_books()
            try:
                async with relay.transaction() as tx:
                    fresh = await tx.claim(
                        [got.envelope.event_id for got, _ in parsed if got.record.topic in ONCE]
                    )
                    now = time.time()
                    for got, payload in parsed:
                        if got.record.topic in ONCE and got.envelope.event_id not in fresh:
                            continue
                        apply(payload, got.envelope.occurred_at.timestamp(), now)
                    await save(tx.conn, book.dirty_services, book.dirty_replicas, book.dropped)
                    await save_deployments(tx.conn, fleets.dirty)
                    book.dirty_replicas, book.dropped = set(), set()
                    tx.emit(dead)
            except BaseException:
                # What was applied in memory did not become durable: the books are read
                # again before anything else, and the batch is retried on them.
                state["stale"] = True
                raise

    def apply(payload: BaseModel, at: float, now: float) -> None:
        if isinstance(payload, ServiceDeclared):
            try:
                book.declare(payload.spec, now)
            except Refused as error:
                refuse(payload.spec.name, payload.spec.tenant, str(error))
        elif isinstance(payload, ServiceCommand):
            try:
                book.command(payload, now)
            except Refused as error:
                refuse(payload.service, payload.tenant, str(error))
        elif isinstance(payload, ReplicaReported):
            book.report(payload, at, now)
        elif isinstance(payload, JobPreempted):
            book.preempted(payload.job_id, payload.attempt, now)
        elif isinstance(payload, RunFailed):
            why = payload.message
            book.ended(payload.job_id, failed=True, now=now, why=why, attempt=payload.attempt)
        elif isinstance(payload, JobCancelRequested) and payload.requested_by != NAME:
            # Someone stopped a replica by hand: it goes, and a new one takes its place.
            book.ended(payload.job_id, failed=False, now=now)
        elif isinstance(payload, JobRejected) and payload.job_id:
            why = f"{payload.reason_code.value}: {payload.message}"
            book.ended(payload.job_id, failed=True, now=now, why=why)
        elif isinstance(payload, RobotInventory):
            fleets.inventory(payload, now)
        elif isinstance(payload, DeploymentDeclared):
            try:
                fleets.declare(payload.spec, now)
            except deployments.Refused as error:
                refuse_deployment(payload.spec.name, payload.spec.tenant, str(error))
        elif isinstance(payload, DeploymentCommand):
            try:
                fleets.command(payload, now)
            except deployments.Refused as error:
                refuse_deployment(payload.deployment, payload.tenant, str(error))

    def refuse_deployment(name: str, tenant: str, reason: str) -> None:
        metrics.refused.inc()
        log.warning("refused", deployment=name, tenant=tenant, reason=reason)
        rec = fleets.records.get(name)
        if rec is not None and rec.spec.tenant == tenant:
            rec.reason = f"refused: {reason}"
            rec.revision += 1
            fleets.dirty.add(name)

    def refuse(name: str, tenant: str, reason: str) -> None:
        metrics.refused.inc()
        log.warning("refused", service=name, tenant=tenant, reason=reason)
        rec = book.services.get(name)
        if rec is not None and rec.spec.tenant == tenant and not rec.deleted:
            rec.change, rec.reason = "refused", reason
            rec.revision += 1
            book.dirty_services.add(name)

    consumers.subscribe(*PAYLOADS, group_id=settings.group_id, handle=handle)

    async def save(conn: Any, services: set[str], replicas: set[str], dropped: set[str]) -> None:
        rows = [
            (n, book.services[n].spec.tenant, json.dumps(book.services[n].to_json()))
            for n in sorted(services)
            if n in book.services
        ]
        if rows:
            await conn.executemany(
                "INSERT INTO serving.services (name, tenant, record) VALUES ($1, $2, $3)"
                " ON CONFLICT (name) DO UPDATE SET tenant = EXCLUDED.tenant,"
                " record = EXCLUDED.record, updated_at = now()",
                rows,
            )
        reps = [
            (j, book.replicas[j].service, json.dumps(book.replicas[j].to_json()))
            for j in sorted(replicas)
            if j in book.replicas
        ]
        if reps:
            await conn.executemany(
                "INSERT INTO serving.replicas (job_id, service, record) VALUES ($1, $2, $3)"
                " ON CONFLICT (job_id) DO UPDATE SET record = EXCLUDED.record",
                reps,
            )
        gone = sorted(j for j in dropped if j not in book.replicas)
        if gone:
            await conn.execute("DELETE FROM serving.replicas WHERE job_id = ANY($1::text[])", gone)

    async def load_books() -> None:
        """The books as stored (what load reports, inventories and liveness say is kept)."""
        pool = state["pool"]
        services = [
            ServiceRecord.from_json(json.loads(r["record"]))
            for r in await pool.fetch("SELECT record FROM serving.services")
        ]
        replicas = [
            ReplicaRecord.from_json(json.loads(r["record"]))
            for r in await pool.fetch("SELECT record FROM serving.replicas")
        ]
        records = [
            DeploymentRecord.from_json(json.loads(r["record"]))
            for r in await pool.fetch("SELECT record FROM serving.deployments")
        ]
        book.services = {rec.name: rec for rec in services}
        book.replicas = {rep.job_id: rep for rep in replicas}
        book.dirty_services, book.dirty_replicas, book.dropped = set(), set(), set()
        fleets.records = {d.spec.name: d for d in records}
        fleets.dirty = set()
        state["stale"] = False

    async def fresh_books() -> None:
        if state.get("stale"):
            await load_books()
            log.warning("books read again after a failed write")

    async def save_deployments(conn: Any, names: set[str]) -> None:
        rows = [
            (n, fleets.records[n].spec.tenant, json.dumps(fleets.records[n].to_json()))
            for n in sorted(names)
            if n in fleets.records
        ]
        if rows:
            await conn.executemany(
                "INSERT INTO serving.deployments (name, tenant, record) VALUES ($1, $2, $3)"
                " ON CONFLICT (name) DO UPDATE SET record = EXCLUDED.record, updated_at = now()",
                rows,
            )

    async def decide_loop() -> None:
        while True:
            await asyncio.sleep(settings.decide_every_s)
            try:
                await decide_once()
            except Exception as error:  # the store may be away: the next round tries again
                log.warning("serving round failed", error=str(error))

    async def decide_once() -> None:
        singleton = runtime.singleton
        if singleton is not None and not singleton.holds():
            return  # frozen past the lease: a successor may be deciding
        relay: OutboxRelay = state["relay"]
        async with lock:
            await fresh_books()
            now = time.time()
            out = book.round(now)
            robots = fleets.round(now)
            messages = _messages(out) + _fleet_messages(robots)
            changed = out.changed_services or out.changed_replicas or out.dropped_replicas
            if not (messages or changed or robots.changed):
                return
            try:
                async with relay.transaction() as tx:
                    tx.emit(messages)
                    await save(
                        tx.conn, out.changed_services, out.changed_replicas, out.dropped_replicas
                    )
                    await save_deployments(tx.conn, robots.changed)
            except BaseException:
                # The round's submissions and stops were not sent: forget it (the books are
                # read again) and decide afresh next round.
                state["stale"] = True
                raise
        metrics.started.inc(len(out.submit))
        metrics.stopped.inc(len(out.stop))
        metrics.services.set(sum(1 for s in book.services.values() if not s.deleted))
        counts: dict[str, int] = {}
        for r in book.replicas.values():
            counts[r.state.value] = counts.get(r.state.value, 0) + 1
        for value in ("pending", "starting", "ready", "failed"):
            metrics.replicas.labels(value).set(counts.get(value, 0))
        for d in robots.statuses:
            log.info(
                "deployment status",
                deployment=d.deployment,
                phase=d.phase.value,
                version=d.version,
                wave=f"{d.wave}/{d.waves}",
                on_version=d.on_version,
                selected=d.selected,
                reason=d.reason,
            )
        for status in out.statuses:
            metrics.changes.labels(status.change or "replicas").inc()
            log.info(
                "service status",
                service=status.service,
                phase=status.phase.value,
                version=status.version,
                desired=status.desired_replicas,
                ready=status.ready_replicas,
                change=status.change,
                reason=status.reason,
            )

    @runtime.on_startup
    async def start() -> None:
        pool, relay = await open_outboxed(
            runtime, broker, consumers, schema=NAME, migrations=MIGRATIONS
        )
        state["relay"], state["pool"] = relay, pool
        await load_books()
        runtime.background(decide_loop)
        await consumers.start()
        log.info("serving started", services=len(book.services), replicas=len(book.replicas))

    app = create_http_app(runtime)
    app.state.runtime = runtime
    app.state.serving = book
    app.state.deployments = fleets
    return app


def _messages(out: RoundOut) -> list[OutMessage]:
    messages = [
        OutMessage(
            topics.JOB_SUBMITTED,
            spec.job_id or "",
            envelope_for("JobSubmitted", spec, producer=NAME, tenant=spec.tenant),
        )
        for spec in out.submit
    ]
    messages += [
        OutMessage(
            topics.JOB_CANCEL_REQUESTED,
            job_id,
            envelope_for(
                "JobCancelRequested",
                JobCancelRequested(job_id=job_id, requested_by=NAME, reason=reason[:1000]),
                producer=NAME,
                tenant=tenant,
            ),
        )
        for job_id, tenant, reason in out.stop
    ]
    messages += [
        OutMessage(
            topics.SERVICE_STATUS,
            status.service,
            envelope_for("ServiceStatus", status, producer=NAME, tenant=status.tenant),
        )
        for status in out.statuses
    ]
    return messages


def _fleet_messages(out: FleetRound) -> list[OutMessage]:
    messages = [
        OutMessage(
            topics.ROBOT_DESIRED,
            f"{d.cluster}/{d.robot}/{d.model}",  # the state is per robot and model
            envelope_for("RobotDesired", d, producer=NAME),
        )
        for d in out.desired
    ]
    messages += [
        OutMessage(
            topics.DEPLOYMENT_STATUS,
            s.deployment,
            envelope_for("DeploymentStatus", s, producer=NAME, tenant=s.tenant),
        )
        for s in out.statuses
    ]
    return messages
