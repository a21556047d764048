"""Applying the scheduler's topics to its state (the feed's side), the scheduler's metrics, and
the leader's fences. The leader's cycle is in cycle.py, its loop in leadership.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import BaseModel, ValidationError

from schemas import topics
from schemas.envelope import Envelope, parse_envelope
from schemas.events import (
    ClusterCapacity,
    JobFinished,
    JobPreempted,
    JobQueued,
    LeaderFence,
    PlacementHead,
    PlacementRefused,
    PreemptionCanceled,
    PreemptionRequested,
    RunFailed,
)
from schemas.health import NodeRecovered, NodeUnhealthy
from schemas.registry import parse_typed
from schemas.usage import BudgetExceeded
from services.common.kafka import OutMessage, decode_key, envelope_for
from services.scheduler.figures import FleetFigures, TenantFigures
from services.scheduler.state import SchedulerState

log = structlog.get_logger()
PRODUCER = "scheduler"
# The header a leader's placement carries its envelope's event id in (see `_own`).
OWN_HEADER = "event_id"
# Queue waits run from a moment (an idle fleet) to days (a big gang on a busy one).
WAIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)

# What the scheduler reads, and each topic's payload (a leader's fence rides on them too).
PAYLOADS: dict[str, type[BaseModel]] = {
    topics.CLUSTER_CAPACITY: ClusterCapacity,
    topics.JOB_QUEUED: JobQueued,
    # Without the spec: the state takes a placed job from its job.queued (SpecHead).
    topics.PLACEMENT_DECIDED: PlacementHead,
    topics.PLACEMENT_REFUSED: PlacementRefused,
    topics.JOB_FINISHED: JobFinished,
    topics.JOB_PREEMPTED: JobPreempted,
    topics.JOB_RUN_FAILED: RunFailed,
    topics.PREEMPTION_REQUESTED: PreemptionRequested,
    topics.PREEMPTION_CANCELED: PreemptionCanceled,
    topics.NODE_UNHEALTHY: NodeUnhealthy,
    topics.NODE_RECOVERED: NodeRecovered,
    topics.BUDGET_EXCEEDED: BudgetExceeded,
}
FEED_TOPICS = tuple(PAYLOADS)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.showing = False  # the leader's figures (`show`) are set
        self.cycle = Histogram("qm_scheduler_cycle_seconds", "One decide cycle", registry=registry)
        self.placed = Counter(
            "qm_scheduler_placements_total", "Placements decided", registry=registry
        )
        self.pending = Gauge("qm_scheduler_pending_jobs", "Jobs waiting", registry=registry)
        self.running = Gauge(
            "qm_scheduler_running_jobs", "Jobs holding capacity", registry=registry
        )
        self.skipped = Counter(
            "qm_scheduler_bad_records_total", "Records that did not parse", registry=registry
        )
        self.leader = Gauge(
            "qm_scheduler_is_leader", "1 while this process leads", registry=registry
        )
        self.working_rebuilds = Gauge(
            "qm_scheduler_working_set_rebuilds",
            "Times the working set was rebuilt from the whole state (fleet or policy changed)",
            registry=registry,
        )
        self.working_drifts = Gauge(
            "qm_scheduler_working_set_drifts",
            "Periodic checks that found the kept working set differing from a rebuilt one",
            registry=registry,
        )
        self.caught_up = Gauge(
            "qm_scheduler_caught_up",
            "1 once the feed has applied everything published before this process started",
            registry=registry,
        )
        self.start_seconds = Gauge(
            "qm_scheduler_start_seconds",
            "From process start until caught up (snapshot load plus reading the rest)",
            registry=registry,
        )
        self.start_records = Gauge(
            "qm_scheduler_start_records",
            "Records read from the topics until caught up at start",
            registry=registry,
        )
        self.resumed = Gauge(
            "qm_scheduler_resumed_from_snapshot",
            "1 when this process started from a snapshot rather than the whole log",
            registry=registry,
        )
        self.snapshots = Counter(
            "qm_scheduler_snapshots_total",
            "Snapshots taken: saved, superseded (the store had a newer one) or failed",
            ["outcome"],
            registry=registry,
        )
        self.snapshot_capture = Histogram(
            "qm_scheduler_snapshot_capture_seconds",
            "Encoding the state for a snapshot (the event loop waits for it)",
            registry=registry,
        )
        self.snapshot_bytes = Gauge(
            "qm_scheduler_snapshot_bytes", "Size of the last snapshot taken", registry=registry
        )
        self.dropped = Counter(
            "qm_scheduler_cycles_dropped_total",
            "Cycles decided after the lease was lost, and not published",
            registry=registry,
        )
        self.publish_failed = Counter(
            "qm_scheduler_publish_failures_total",
            "Cycles whose publish failed in whole or part (only what the broker acknowledged "
            "was applied; the rest is decided again)",
            registry=registry,
        )
        self.cycle_failures = Counter(
            "qm_scheduler_cycle_failures_total",
            "Cycles that raised, by error type (the leader backs off and decides again)",
            ["error"],
            registry=registry,
        )
        self.redis_outages = Counter(
            "qm_scheduler_redis_outages_total",
            "Times the leader lease's Redis stopped answering (the scheduler stood by)",
            registry=registry,
        )
        self.publish = Histogram(
            "qm_scheduler_publish_seconds",
            "From the start of a cycle's publish until the broker answered every message",
            registry=registry,
        )
        self.preemptions = Counter(
            "qm_scheduler_preemptions_requested_total",
            "Victims asked to yield",
            ["reason"],
            registry=registry,
        )
        self.queue_wait = Histogram(
            "qm_scheduler_queue_wait_seconds",
            "From a job's submission to its first placement (wall seconds)",
            ["tenant", "queue", "priority_class"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        # queue_wait's children by labels: `labels()` cost as much as the rest of applying a
        # placement (3-4% of the leader under a burst, py-spy).
        self._waits: dict[tuple[str, str, str], Histogram] = {}
        self.jobs = Gauge(
            "qm_scheduler_jobs",
            "Jobs the leader holds, by state: pending, backing_off, running, preempting",
            ["state", "tenant"],
            registry=registry,
        )
        self.pending_reasons = Gauge(
            "qm_scheduler_pending_by_reason",
            "Pending jobs by the first reason code of their explanation",
            ["tenant", "reason"],
            registry=registry,
        )
        tenant_type = ["tenant", "accelerator_type"]
        self.quota = Gauge(
            "qm_tenant_quota_accelerators",
            "Nominal quota per tenant and accelerator type (tenants with quotas only)",
            tenant_type,
            registry=registry,
        )
        self.allocated = Gauge(
            "qm_tenant_allocated_accelerators",
            "Accelerators each tenant's running work holds, per type",
            tenant_type,
            registry=registry,
        )
        self.borrowed = Gauge(
            "qm_tenant_borrowed_accelerators",
            "Accelerators held above nominal quota, borrowed from the tenant's cohort",
            tenant_type,
            registry=registry,
        )
        self.dominant_share = Gauge(
            "qm_tenant_dominant_share",
            "Dominant-resource share of the fleet the tenant's running work holds (0-1)",
            ["tenant"],
            registry=registry,
        )
        self.fair_share = Gauge(
            "qm_tenant_fair_share",
            "The tenant's entitlement: its weight over the weights of tenants with work (0-1)",
            ["tenant"],
            registry=registry,
        )
        self.ordering_share = Gauge(
            "qm_tenant_ordering_share",
            "What tenants are ordered by: (dominant share + decayed past use) / weight; "
            "lower goes first",
            ["tenant"],
            registry=registry,
        )
        self.accelerators = Gauge(
            "qm_fleet_accelerators",
            "Accelerators by state: allocated, idle, held (for a waiting gang), unhealthy",
            ["cluster", "accelerator_type", "state"],
            registry=registry,
        )
        self.free_slots = Gauge(
            "qm_fleet_free_slots",
            "Replicas of `size` whole devices that could start now (untouched devices of "
            "healthy nodes not held for a gang)",
            ["cluster", "accelerator_type", "size"],
            registry=registry,
        )
        self.fragmentation = Gauge(
            "qm_fleet_fragmentation_ratio",
            "Share of free accelerators that are not on a wholly free node (0-1)",
            ["cluster", "accelerator_type"],
            registry=registry,
        )

    def show(
        self,
        jobs: Mapping[tuple[str, str], int],
        reasons: Mapping[tuple[str, str], int],
        tenants: TenantFigures,
        fleet: FleetFigures,
    ) -> None:
        """Replace the leader's figures (labels that are gone disappear)."""
        figures: list[tuple[Gauge, Mapping[Any, float]]] = [
            (self.jobs, jobs),
            (self.pending_reasons, reasons),
            (self.quota, tenants.quota),
            (self.allocated, tenants.allocated),
            (self.borrowed, tenants.borrowed),
            (self.dominant_share, {(t,): v for t, v in tenants.dominant_share.items()}),
            (self.fair_share, {(t,): v for t, v in tenants.fair_share.items()}),
            (self.ordering_share, {(t,): v for t, v in tenants.ordering_share.items()}),
            (self.accelerators, fleet.accelerators),
            (self.free_slots, fleet.free_slots),
            (self.fragmentation, fleet.fragmentation),
        ]
        for gauge, values in figures:
            gauge.clear()
            for labels, value in values.items():
                gauge.labels(*labels).set(value)
        self.showing = bool(jobs or tenants.quota or tenants.fair_share or fleet.accelerators)

    def waited(self, tenant: str, queue: str, priority_class: str, seconds: float) -> None:
        """Observes one job's wait from submission to its first placement."""
        key = (tenant, queue, priority_class)
        child = self._waits.get(key)
        if child is None:
            child = self._waits[key] = self.queue_wait.labels(*key)
        child.observe(seconds)

    def forget_figures(self) -> None:
        """A replica that no longer leads shows none (its figures would go stale)."""
        if self.showing:
            self.show({}, {}, TenantFigures(), FleetFigures())


def apply_records(
    state: SchedulerState, records: list[ConsumerRecord[Any, Any]], metrics: SchedulerMetrics
) -> None:
    """Feed records into the state, one at a time: a record that cannot be read, or that the
    state cannot apply, is skipped (logged, counted) and never stops the records after it.
    Dead-lettering is the owning consumers' job (every one of these topics has one)."""
    for record in records:
        if state.own and record.topic == topics.PLACEMENT_DECIDED and _own(state, record):
            continue
        try:
            # One pass when the record is its topic's current payload; else the usual way.
            env = parse_typed(record.value, PAYLOADS.get(record.topic)) or parse_envelope(
                record.value or b""
            )
            _apply(state, record, env)
        except (ValidationError, ValueError) as exc:
            metrics.skipped.inc()
            log.warning(
                "skipping unreadable record",
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
                error=str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
            )
        except Exception:
            metrics.skipped.inc()
            log.exception(
                "skipping a record the state could not apply",
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
            )


def _own(state: SchedulerState, record: ConsumerRecord[Any, Any]) -> bool:
    """Whether the record is one of this leader's placements, read back: its event id (in
    the OWN_HEADER header) is one the leader applied for the job of the record's key. A record
    that only claims to be (a forged header) is passed by only where the real one, same event
    and job, was applied: nothing is lost by not reading it."""
    for name, value in record.headers or ():
        if name != OWN_HEADER:
            continue
        event_id = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        if state.own.get(event_id) != decode_key(record):
            return False
        del state.own[event_id]
        return True
    return False


def _apply(state: SchedulerState, record: ConsumerRecord[Any, Any], env: Envelope) -> None:
    topic = record.topic
    if env.type == topics.LEADER_FENCE:
        state.on_fence(topic, record.partition, LeaderFence.model_validate(env.payload).epoch)
    elif topic == topics.JOB_QUEUED:
        state.on_queued(JobQueued.model_validate(env.payload))
    elif topic == topics.PLACEMENT_DECIDED:
        state.on_placed(PlacementHead.model_validate(env.payload), env.occurred_at.timestamp())
    elif topic == topics.PLACEMENT_REFUSED:
        state.on_refused(PlacementRefused.model_validate(env.payload), env.occurred_at.timestamp())
    elif topic == topics.JOB_FINISHED:
        state.on_finished(JobFinished.model_validate(env.payload))
    elif topic == topics.JOB_PREEMPTED:
        state.on_preempted(JobPreempted.model_validate(env.payload))
    elif topic == topics.JOB_RUN_FAILED:
        state.on_preempted(RunFailed.model_validate(env.payload))
    elif topic == topics.PREEMPTION_REQUESTED:
        state.on_preemption_requested(PreemptionRequested.model_validate(env.payload))
    elif topic == topics.PREEMPTION_CANCELED:
        state.on_preemption_canceled(
            PreemptionCanceled.model_validate(env.payload), env.occurred_at.timestamp()
        )
    elif topic == topics.CLUSTER_CAPACITY:
        state.on_capacity(ClusterCapacity.model_validate(env.payload))
    elif topic == topics.BUDGET_EXCEEDED:
        state.on_budget(BudgetExceeded.model_validate(env.payload))
    elif topic == topics.NODE_UNHEALTHY:
        state.on_node_health(NodeUnhealthy.model_validate(env.payload).node_id, healthy=False)
    elif topic == topics.NODE_RECOVERED:
        state.on_node_health(NodeRecovered.model_validate(env.payload).node_id, healthy=True)


def fence_messages(epoch: int, leader: str, partitions: list[tuple[str, int]]) -> list[OutMessage]:
    """A new leader's fence, one per partition of the topics it decides on (see LeaderFence)."""
    fence = LeaderFence(epoch=epoch, leader=leader)
    return [
        OutMessage(
            topic,
            f"fence-{epoch}",
            envelope_for(topics.LEADER_FENCE, fence, producer=PRODUCER),
            partition=partition,
        )
        for topic, partition in partitions
    ]
