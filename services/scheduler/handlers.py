"""Applying the scheduler's topics to its state, and the leader's decide-then-publish cycle."""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import structlog
from aiokafka import ConsumerRecord
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import ValidationError

from core.cycle import schedule
from core.decisions import PreemptionDecision
from core.fairshare import accrue
from core.model import Allocation, JobId, TenantId
from core.policy import Policy
from core.reasons import PendingExplanation, ReasonCode
from schemas import topics
from schemas.envelope import Envelope, parse_envelope
from schemas.events import Claim as WireClaim
from schemas.events import (
    ClusterCapacity,
    JobFinished,
    JobPreempted,
    JobQueued,
    LeaderFence,
    PendingExplained,
    PlacementDecided,
    PlacementRefused,
    PreemptionCanceled,
    PreemptionRequested,
    RunFailed,
)
from schemas.health import NodeRecovered, NodeUnhealthy
from schemas.usage import BudgetExceeded
from services.common.kafka import OutMessage, envelope_for, publish_all
from services.scheduler.convert import placement_event
from services.scheduler.state import SchedulerState

log = structlog.get_logger()
PRODUCER = "scheduler"
EXPLAIN_EVERY_S = 10.0
# A big backlog changes thousands of sentences per cycle; publishing them all made one cycle's
# publish take seconds (measured under the chaos mix: ~5,000 messages, up to 2.6 s, against a
# 3 s lease). What does not go out now goes out in a later cycle.
EXPLAIN_PER_CYCLE = 500

FEED_TOPICS = (
    topics.CLUSTER_CAPACITY,
    topics.JOB_QUEUED,
    topics.PLACEMENT_DECIDED,
    topics.PLACEMENT_REFUSED,
    topics.JOB_FINISHED,
    topics.JOB_PREEMPTED,
    topics.JOB_RUN_FAILED,
    topics.PREEMPTION_REQUESTED,
    topics.PREEMPTION_CANCELED,
    topics.NODE_UNHEALTHY,
    topics.NODE_RECOVERED,
    topics.BUDGET_EXCEEDED,
)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
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
        self.dropped = Counter(
            "qm_scheduler_cycles_dropped_total",
            "Cycles decided after the lease was lost, and not published",
            registry=registry,
        )
        self.publish_failed = Counter(
            "qm_scheduler_publish_failures_total",
            "Cycles whose publish failed (nothing of them applied; decided again)",
            registry=registry,
        )
        self.publish = Histogram(
            "qm_scheduler_publish_seconds",
            "From the lease renewal that let a cycle go out until the broker had all of it",
            registry=registry,
        )
        self.preemptions = Counter(
            "qm_scheduler_preemptions_requested_total",
            "Victims asked to yield",
            ["reason"],
            registry=registry,
        )


def apply_records(
    state: SchedulerState, records: list[ConsumerRecord[Any, Any]], metrics: SchedulerMetrics
) -> None:
    """Feed records into the state, one at a time: a record that cannot be read, or that the
    state cannot apply, is skipped (logged, counted) and never stops the records after it.
    Dead-lettering is the owning consumers' job (every one of these topics has one)."""
    for record in records:
        try:
            env = parse_envelope(record.value or b"")
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


def _apply(state: SchedulerState, record: ConsumerRecord[Any, Any], env: Envelope) -> None:
    topic = record.topic
    if env.type == topics.LEADER_FENCE:
        state.on_fence(topic, record.partition, LeaderFence.model_validate(env.payload).epoch)
    elif topic == topics.JOB_QUEUED:
        state.on_queued(JobQueued.model_validate(env.payload))
    elif topic == topics.PLACEMENT_DECIDED:
        state.on_placed(PlacementDecided.model_validate(env.payload), env.occurred_at.timestamp())
    elif topic == topics.PLACEMENT_REFUSED:
        state.on_refused(PlacementRefused.model_validate(env.payload))
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


def worth_telling(
    pending: Mapping[JobId, PendingExplanation],
    told: Mapping[JobId, tuple[tuple[str, ...], str, float]],
    now: float,
    limit: int = EXPLAIN_PER_CYCLE,
) -> list[JobId]:
    """The pending jobs whose explanation should go out now, at most `limit`: first jobs never
    told, then jobs whose reason codes changed, then changed sentences (same codes) told
    longest ago, once EXPLAIN_EVERY_S has passed since they were."""
    ranked: list[tuple[int, float, JobId]] = []
    for job_id, why in pending.items():
        codes = tuple(str(c) for c in why.codes)
        last = told.get(job_id)
        if last is None:
            ranked.append((0, 0.0, job_id))
        elif last[0] != codes:
            ranked.append((1, last[2], job_id))
        elif last[1] != why.message and now - last[2] >= EXPLAIN_EVERY_S:
            ranked.append((2, last[2], job_id))
    if len(ranked) > limit:
        ranked = heapq.nsmallest(limit, ranked, key=lambda r: (r[0], r[1]))
    return [job_id for *_, job_id in ranked]


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


class Cycle:
    """Decide with the core, publish the decisions, then apply them to the state: a publish
    that fails leaves the state as the log has it (no phantom placement holding capacity),
    and the jobs are decided again."""

    def __init__(
        self,
        state: SchedulerState,
        policy: Policy,
        broker: KafkaBroker,
        metrics: SchedulerMetrics,
        leader: str,
        seed: int,
        time_scale: float = 1.0,
    ) -> None:
        self.state = state
        self.policy = policy
        self.broker = broker
        self.metrics = metrics
        self.leader = leader
        self.rng = random.Random(seed)
        self.time_scale = time_scale
        # What each pending job was last told, so only changes go out.
        self.told: dict[JobId, tuple[tuple[str, ...], str, float]] = {}
        self.usage: dict[TenantId, float] = {}
        self.last_accrual: float | None = None

    def _policy_for(self, now: float) -> Policy:
        """The policy with this month's budget deprioritizations applied to tenant weights."""
        month = datetime.fromtimestamp(now, UTC).strftime("%Y-%m")
        factors = self.state.weight_factors(month)
        if not factors:
            return self.policy
        tenants = {
            name: replace(t, weight=t.weight * factors.get(name, 1.0))
            for name, t in self.policy.tenants.items()
        }
        return replace(self.policy, tenants=tenants)

    def _accrue(self, now: float) -> None:
        """Decayed past usage per tenant, in fleet (virtual) accelerator-seconds."""
        elapsed = 0.0 if self.last_accrual is None else max(0.0, now - self.last_accrual)
        self.last_accrual = now
        self.usage = accrue(
            self.usage,
            self.state.running.values(),
            elapsed * self.time_scale,
            self.policy.fair_share.half_life_s,
        )

    async def run_once(
        self,
        epoch: int,
        now: float | None = None,
        still_leading: Callable[[], Awaitable[bool]] | None = None,
    ) -> int:
        """One cycle at wall-clock time `now`; the core decides in fleet time.

        `still_leading` is asked after deciding and before anything is applied or published: a
        long cycle can outlast the lease, and a deposed leader's decisions must not go out
        next to its successor's (executors fence old epochs only once they have seen the new
        one). Nothing of a dropped cycle touches the state."""
        state = self.state
        now = time.time() if now is None else now
        with self.metrics.cycle.time():
            state.dirty = False
            self._accrue(now)
            snapshot = replace(state.snapshot(now), usage=self.usage)
            policy = self._policy_for(now)
            result = schedule(snapshot, policy, state.fleet_time(now), self.rng)
            # Built at once, from the state the core decided on (no await in between); the
            # state itself changes only once the broker has all of it.
            placements = [p for alloc in result.placements if (p := self._placement(alloc, epoch))]
            requests = [
                r
                for decision in result.preemptions
                for r in self._preemptions(decision, policy, epoch)
            ]
            pending = dict(result.pending)
            pending.update(self._backoffs(now))
            explained, told = self._explanations(pending, now)
        if still_leading is not None and not await still_leading():
            log.warning("lost the lease during a cycle; its decisions are dropped")
            self.metrics.dropped.inc()
            return 0
        renewed = time.monotonic()
        out = [m for m, _ in placements] + [m for m, _ in requests] + explained
        if out:
            try:
                await publish_all(self.broker, out)
            except Exception:
                # Nothing of this cycle is applied: what did reach the broker comes back
                # through the feed like any placement; the rest is decided again.
                self.metrics.publish_failed.inc()
                state.dirty = True
                raise
            took = time.monotonic() - renewed
            self.metrics.publish.observe(took)
            if took > 1.0:
                log.warning("slow publish", seconds=round(took, 3), messages=len(out), epoch=epoch)
        # Apply what went out. The feed may have moved the state meanwhile (a cancel, a
        # node gone): applying is idempotent and skips what no longer applies.
        for _, placed_event in placements:
            state.on_placed(placed_event, now)
            self.told.pop(JobId(placed_event.job_id), None)
        for _, request in requests:
            state.on_preemption_requested(request)
            self.metrics.preemptions.labels(request.reason_code).inc()
        self.told.update(told)
        self.metrics.placed.inc(len(placements))
        self.metrics.pending.set(len(state.pending))
        self.metrics.running.set(len(state.running))
        return len(placements)

    def _placement(
        self, alloc: Allocation, epoch: int
    ) -> tuple[OutMessage, PlacementDecided] | None:
        state = self.state
        job_id = alloc.job.job_id
        node = state.nodes.get(alloc.replicas[0].node_id)
        queued = state.queued.get(job_id)
        if node is None or queued is None:  # cannot happen between decide and here; be safe
            log.warning("placement for a job or node no longer known; dropped", job_id=job_id)
            return None
        event = placement_event(
            alloc,
            queued,
            attempt=state.next_attempt(job_id),
            epoch=epoch,
            leader=self.leader,
            accelerator_type=node.accelerator.type,
        )
        env = envelope_for("PlacementDecided", event, producer=PRODUCER, tenant=alloc.job.tenant)
        # Executors skip other clusters' placements by this header, unparsed.
        message = OutMessage(
            topics.PLACEMENT_DECIDED, job_id, env, headers=(("cluster", str(alloc.cluster)),)
        )
        return message, event

    def _preemptions(
        self, decision: PreemptionDecision, policy: Policy, epoch: int
    ) -> list[tuple[OutMessage, PreemptionRequested]]:
        """Ask the preemptor to make room: one request per victim, keyed by the victim.

        Claims go on the wire so the preemptor can check "never for a claim that is not
        higher" on its own: rank from the policy; quota standing and service level follow
        from the mechanism the core used (reclaim: borrowed vs guaranteed; LAS: more vs less
        attained service at the same rank and standing)."""
        state = self.state
        requester = state.pending.get(decision.for_job)
        if requester is None:
            return []
        out = []
        for victim in decision.victims:
            alloc = state.running.get(victim.job_id)
            attempt = state.running_attempt.get(victim.job_id)
            queued = state.queued.get(victim.job_id)
            if alloc is None or attempt is None or queued is None:
                continue
            reclaim = victim.reason is ReasonCode.RECLAIMED_BORROWED
            las = victim.reason is ReasonCode.PREEMPTED_ATTAINED_SERVICE
            event = PreemptionRequested(
                job_id=victim.job_id,
                attempt=attempt,
                cluster=alloc.cluster,
                tenant=alloc.job.tenant,
                priority_class=alloc.job.priority_class,
                claim=WireClaim(
                    rank=policy.rank(alloc.job.priority_class),
                    guaranteed=not reclaim,
                    level=1 if las else 0,
                ),
                for_job=requester.job_id,
                for_tenant=requester.tenant,
                for_priority_class=requester.priority_class,
                for_claim=WireClaim(rank=policy.rank(requester.priority_class), guaranteed=True),
                reason_code=str(victim.reason),
                message=victim.message,
                grace_s=queued.spec.checkpoint_grace_s,
                epoch=epoch,
                leader=self.leader,
            )
            env = envelope_for(
                "PreemptionRequested", event, producer=PRODUCER, tenant=alloc.job.tenant
            )
            out.append((OutMessage(topics.PREEMPTION_REQUESTED, victim.job_id, env), event))
        return out

    def _backoffs(self, now: float) -> dict[JobId, PendingExplanation]:
        """Why a requeued job backing off is not placed yet."""
        out = {}
        for job_id, until in self.state.backing_off(now).items():
            at = datetime.fromtimestamp(until, UTC).strftime("%H:%M:%S")
            out[job_id] = PendingExplanation(
                codes=(ReasonCode.BACKING_OFF,),
                message=f"backing off after its last run ended; may be placed from {at} UTC",
            )
        return out

    def _explanations(
        self, pending: Mapping[JobId, PendingExplanation], now: float
    ) -> tuple[list[OutMessage], dict[JobId, tuple[tuple[str, ...], str, float]]]:
        """A job's reason goes out when its codes change; a changed sentence with the same
        codes (e.g. "behind 12 jobs" becoming "behind 11") at most every EXPLAIN_EVERY_S; and
        at most EXPLAIN_PER_CYCLE in one cycle (see `worth_telling`). Returns the messages and
        what each job will have been told once they are out."""
        out = []
        told: dict[JobId, tuple[tuple[str, ...], str, float]] = {}
        for job_id in [j for j in self.told if j not in self.state.pending]:
            del self.told[job_id]
        current = {j: why for j, why in pending.items() if j in self.state.pending}
        for job_id in worth_telling(current, self.told, now):
            why = current[job_id]
            codes = tuple(str(c) for c in why.codes)
            told[job_id] = (codes, why.message, now)
            event = PendingExplained(
                job_id=job_id, codes=list(codes), message=why.message, pending_jobs=len(pending)
            )
            tenant = self.state.pending[job_id].tenant
            env = envelope_for("PendingExplained", event, producer=PRODUCER, tenant=tenant)
            out.append(OutMessage(topics.SCHEDULING_EXPLAINED, job_id, env))
        return out, told
