"""The queue's batch handler: read, dedupe, plan, write in one transaction, then relay."""

from __future__ import annotations

import time
from typing import Any

import asyncpg
import structlog
from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter, Histogram

from core.policy import Policy
from schemas.events import JobPreempted, RunFailed
from services.common.outbox import OutboxRelay
from services.common.tracing import Tracing, hops
from services.queue import store
from services.queue.intake import LifecycleEvent, NewJob, read_batch
from services.queue.planning import Plan, item_event_id, item_job_id, plan_batch

log = structlog.get_logger()


class QueueMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.admitted = Counter("qm_queue_jobs_admitted_total", "Jobs queued", registry=registry)
        self.rejected = Counter("qm_queue_jobs_rejected_total", "Jobs rejected", registry=registry)
        self.dead = Counter(
            "qm_queue_dead_letters_total", "Records dead-lettered", registry=registry
        )
        self.duplicates = Counter(
            "qm_queue_duplicates_total", "Redelivered records skipped", registry=registry
        )
        self.wait = Histogram(
            "qm_queue_record_wait_seconds",
            "Age of a batch's oldest record when the handler starts on it",
            registry=registry,
        )
        self.batch = Histogram(
            "qm_queue_batch_seconds", "Time to process one batch", registry=registry
        )
        self.preempted = Counter(
            "qm_queue_runs_preempted_total",
            "Runs the platform ended before the job was done (job.preempted), by the victim's "
            "tenant and reason code",
            ["tenant", "reason"],
            registry=registry,
        )
        self.lost = Counter(
            "qm_queue_preemption_lost_accelerator_seconds_total",
            "Work lost to preemption: fleet seconds since the run's last checkpoint times the "
            "accelerators of its gang",
            ["tenant", "reason"],
            registry=registry,
        )


class QueueProcessor:
    def __init__(
        self,
        pool: asyncpg.Pool,
        relay: OutboxRelay,
        policy: Policy,
        metrics: QueueMetrics,
        time_scale: float = 1.0,
        tracing: Tracing | None = None,
    ) -> None:
        self.pool = pool
        self.tracing = tracing
        self.relay = relay
        self.policy = policy
        self.metrics = metrics
        self.time_scale = time_scale  # fleet seconds per wall second, for requeue backoffs

    async def process(self, records: tuple[ConsumerRecord[Any, Any], ...]) -> Plan:
        oldest = min(r.timestamp for r in records) / 1000 if records else time.time()
        self.metrics.wait.observe(max(0.0, time.time() - oldest))
        # A job's trace continues here, or starts here when its producer did not trace.
        with self.metrics.batch.time(), hops(self.tracing, "queue.admit", root=True) as traced:
            items, dead = read_batch(records)
            seen: set[str] = set()
            unique = []
            for item in items:
                eid = item_event_id(item)
                if eid not in seen:
                    seen.add(eid)
                    unique.append(item)
            async with self.relay.transaction() as tx:
                conn = tx.conn
                fresh = await tx.claim([item_event_id(i) for i in unique])
                todo = [i for i in unique if item_event_id(i) in fresh]
                for i in todo:
                    if isinstance(i, NewJob):
                        spec = i.submission.spec
                        traced.open(
                            i.submission.envelope.event_id,
                            i.traceparent,
                            job_id=i.job_id,
                            tenant=spec.tenant,
                            queue=spec.queue,
                        )
                job_ids = {j for j in (item_job_id(i) for i in todo) if j}
                records_by_id = await store.lock_jobs(conn, job_ids)
                keys = {
                    (i.submission.spec.tenant, i.submission.spec.idempotency_key)
                    for i in todo
                    if isinstance(i, NewJob) and i.submission.spec.idempotency_key
                }
                idem = await store.find_by_idempotency(conn, keys)
                new_ids = [i.job_id for i in todo if isinstance(i, NewJob)]
                early = await store.take_early_cancels(conn, new_ids)
                ended_runs = [
                    i.payload.job_id
                    for i in todo
                    if isinstance(i, LifecycleEvent)
                    and isinstance(i.payload, JobPreempted | RunFailed)
                ]
                specs = await store.job_specs(conn, ended_runs)
                blocks = await store.budget_blocks(conn)
                plan = plan_batch(
                    todo,
                    records_by_id,
                    idem,
                    self.policy,
                    early,
                    specs,
                    blocks,
                    time_scale=self.time_scale,
                )
                await store.save_budget_blocks(
                    conn, [b for k, b in plan.budget_blocks.items() if blocks.get(k) != b]
                )
                await store.insert_jobs(conn, plan.inserts)
                await store.update_jobs(conn, list(plan.updates.values()))
                await store.update_specs(conn, plan.spec_updates)
                await store.add_history(conn, plan.history)
                await store.add_rejections(conn, plan.rejections)
                await store.add_early_cancels(conn, plan.early_cancels)
                traced.stamp(plan.emits)
                tx.emit([*dead, *plan.emits])
        self._count(plan, len(dead), len(unique) - len(todo))
        return plan

    def _count(self, plan: Plan, dead: int, redelivered: int) -> None:
        for event_id, job_id, tenant, reason, message, _at in plan.rejections:
            with structlog.contextvars.bound_contextvars(
                job_id=job_id, tenant=tenant, event_id=event_id
            ):
                log.info("job rejected", reason=reason, detail=message)
        self.metrics.admitted.inc(sum(1 for r, _ in plan.inserts if r.state.value == "queued"))
        self.metrics.rejected.inc(len(plan.rejections))
        self.metrics.dead.inc(dead + sum(1 for m in plan.emits if m.topic == "dead.letter"))
        self.metrics.duplicates.inc(redelivered + plan.duplicates)
        for tenant, reason, lost in plan.preempted:
            self.metrics.preempted.labels(tenant, reason).inc()
            self.metrics.lost.labels(tenant, reason).inc(max(0.0, lost))
