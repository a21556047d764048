"""The leader's cycle in three steps. Decide: the core works on its working set (kept from
cycle to cycle, see working.py), and the decisions are built as messages; nothing of the
scheduler's state changes. Publish: every message is sent and its
acknowledgement awaited. Apply: only what the broker acknowledged enters the state, as the
feed would apply it on reading it back. A publish that fails in whole or in part leaves no
phantom placement (no job `running` in memory, no accelerators that look used) for what did
not go out; those jobs are decided again."""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import structlog
from faststream.kafka import KafkaBroker
from pydantic import ValidationError

from core.cycle import decide
from core.decisions import PreemptionDecision
from core.fairshare import accrue_rates
from core.model import Allocation, JobId, JobRequest, TenantId
from core.policy import Policy
from core.reasons import PendingExplanation, ReasonCode
from schemas import topics
from schemas.events import (
    CapacityDemand,
    DemandItem,
    PendingExplained,
    PlacementDecided,
    PreemptionRequested,
)
from schemas.events import Claim as WireClaim
from services.common.kafka import Outcome, OutMessage, envelope_for
from services.scheduler import figures
from services.scheduler.convert import placement_event
from services.scheduler.emit import publish_each
from services.scheduler.errors import PublishFailed
from services.scheduler.handlers import OWN_HEADER, PRODUCER, SchedulerMetrics
from services.scheduler.state import SchedulerState
from services.scheduler.working import WorkingSet

if TYPE_CHECKING:
    from services.scheduler.traces import Waiting

log = structlog.get_logger()
EXPLAIN_EVERY_S = 10.0
FIGURES_EVERY_S = 1.0
# The capacity demand goes out when it changes, at most every DEMAND_MIN_GAP_S (it can be 2,000
# jobs long, and under a burst it changes every cycle; the autoscaler decides every 2 s), and at
# least every DEMAND_EVERY_S (wall seconds).
DEMAND_MIN_GAP_S = 1.0
DEMAND_EVERY_S = 15.0
DEMAND_MAX = 2000
# A job waits for capacity when one of these explains it, and none of the others below.
CAPACITY_CODES = frozenset(
    {
        ReasonCode.INSUFFICIENT_CAPACITY,
        ReasonCode.CAPACITY_RESERVED,
        ReasonCode.HEAD_OF_LINE_BLOCKED,
        ReasonCode.NO_MATCHING_NODES,
        ReasonCode.TOPOLOGY_TOO_SMALL,
        ReasonCode.REPLICA_TOO_LARGE,
    }
)
# Waits that more nodes would not end: quota, priority, a backoff, victims leaving, a bad spec.
NOT_FOR_CAPACITY = frozenset(
    {
        ReasonCode.QUOTA_EXHAUSTED,
        ReasonCode.BORROW_LIMIT,
        ReasonCode.BACKING_OFF,
        ReasonCode.AWAITING_PREEMPTION,
        ReasonCode.INVALID_REQUEST,
    }
)
# A big backlog changes thousands of sentences per cycle; publishing them all made one cycle's
# publish take seconds (measured under the chaos mix: ~5,000 messages, up to 2.6 s, against a
# 3 s lease). What does not go out now goes out in a later cycle.
EXPLAIN_PER_CYCLE = 500
# Explaining goes through every waiting job, and a cycle under a burst has thousands (measured
# on the dev fleet with 3,000 waiting and 624 placed per cycle: decide 270 ms explaining, 220
# without). With more than EXPLAIN_ALWAYS_UP_TO waiting, a cycle explains only when
# EXPLAIN_GAP_S (wall seconds) has passed since the last one that did; the others decide on
# the core's fast path, which makes the same decisions (tests/unit/core/test_fast_path.py,
# tests/unit/services/test_scheduler_working_set.py). What goes out from explanations (the
# reasons, the capacity demand, the pending-by-reason gauges) is at most that much later; an
# explaining cycle then tells EXPLAIN_PER_CYCLE jobs for itself and for each cycle since the
# last one that explained, up to EXPLAIN_MOST (so the rate at which reasons go out holds).
EXPLAIN_ALWAYS_UP_TO = 500
EXPLAIN_GAP_S = 1.0
EXPLAIN_MOST = 2000

# What a pending job was last told: its reason codes, the sentence, and when (wall time).
Told = tuple[tuple[str, ...], str, float]


def worth_telling(
    pending: Mapping[JobId, PendingExplanation],
    told: Mapping[JobId, Told],
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


@dataclass(frozen=True)
class Decisions:
    """One cycle's decisions as messages, each with what applying it means; not yet applied."""

    epoch: int
    at: float  # wall time of the cycle
    placements: tuple[tuple[OutMessage, PlacementDecided], ...] = ()
    requests: tuple[tuple[OutMessage, PreemptionRequested], ...] = ()
    explained: tuple[tuple[OutMessage, JobId, Told], ...] = ()
    # The pending work waiting for capacity, when it changed or is due again (last).
    demand: tuple[OutMessage, tuple[object, ...]] | None = None
    # Why each pending job waits, as the core (and the backoffs) explained it this cycle, or,
    # when it did not explain (`explaining` False: the fast path), as the last one that did.
    pending: Mapping[JobId, PendingExplanation] = field(default_factory=dict)
    explaining: bool = True

    def messages(self) -> list[OutMessage]:
        return (
            [m for m, _ in self.placements]
            + [m for m, _ in self.requests]
            + [m for m, *_ in self.explained]
            + ([self.demand[0]] if self.demand is not None else [])
        )


class Cycle:
    """Decide with the core, publish the decisions, then apply what the broker has."""

    def __init__(
        self,
        state: SchedulerState,
        policy: Policy,
        broker: KafkaBroker,
        metrics: SchedulerMetrics,
        leader: str,
        time_scale: float = 1.0,
        working: WorkingSet | None = None,
        waiting: Waiting | None = None,
    ) -> None:
        self.state = state
        # Traced jobs waiting for a placement (traces.py); None when tracing is off.
        self.waiting = waiting
        # The core's working set, kept from cycle to cycle (see working.py).
        self.working = working or WorkingSet()
        self.policy = policy
        self.broker = broker
        self.metrics = metrics
        self.leader = leader
        self.time_scale = time_scale
        # What each pending job was last told, so only changes go out.
        self.told: dict[JobId, Told] = {}
        self.usage: dict[TenantId, float] = {}
        self.last_accrual: float | None = None
        # The capacity demand last sent (its jobs, their codes and requests) and when.
        self.demand_sent: tuple[tuple[object, ...], float] | None = None
        # The demand item last built for each job in it, with the request and codes it was
        # built from: a job waiting through a burst is in every demand, unchanged.
        self._demand_items: dict[JobId, tuple[JobRequest, tuple[str, ...], DemandItem]] = {}
        # The policy with budget deprioritizations applied, per (month, factors): the same
        # object while they hold, so the working set is rebuilt only when they change.
        self._weighted: tuple[tuple[str, tuple[tuple[str, float], ...]], Policy] | None = None
        self.figures_at = float("-inf")  # when show_figures last set the gauges (wall time)
        # When a cycle whose explanations were applied last explained the waiting jobs (wall
        # time), what it found, and how many cycles applied since decided without (owed).
        self.explained_at = float("-inf")
        self.explained: Mapping[JobId, PendingExplanation] = {}
        self.owed = 0
        self.explain_always_up_to = EXPLAIN_ALWAYS_UP_TO
        self.explain_gap_s = EXPLAIN_GAP_S
        # The pending-by-reason figures of the last explaining cycle (fast ones keep them).
        self.by_reason: Counter[tuple[str, str]] | None = None

    async def run_once(
        self,
        epoch: int,
        now: float | None = None,
        still_leading: Callable[[], Awaitable[bool]] | None = None,
    ) -> int:
        """One cycle at wall-clock time `now` (the core decides in fleet time); returns the
        number of placements applied. Raises PublishFailed when part of it did not go out.

        `still_leading` is asked after deciding and before publishing: a long cycle can
        outlast the lease, and a deposed leader's decisions must not go out next to its
        successor's (executors fence old epochs only once they have seen the new one)."""
        now = time.time() if now is None else now
        self.state.dirty = False
        with self.metrics.cycle.time():
            decisions = self.decide(epoch, now)
        if still_leading is not None and not await still_leading():
            log.warning("lost the lease during a cycle; its decisions are dropped")
            self.metrics.dropped.inc()
            return 0
        outcomes = await self.publish(decisions)
        placed = self.apply(decisions, outcomes)
        self.show_figures(decisions)
        failed = [exc for exc in outcomes if exc is not None]
        if failed:
            self.metrics.publish_failed.inc()
            self.state.dirty = True  # what did not go out is decided again
            raise PublishFailed(len(failed), len(outcomes), failed[0]) from failed[0]
        return placed

    def decide(self, epoch: int, now: float) -> Decisions:
        """The core's decisions on a snapshot of the state, as messages. Reads the state and
        changes nothing in it (only the cycle's own fair-share accrual moves on); built at
        once, with no await, so every message matches the state the core saw."""
        state = self.state
        policy = self._policy_for(now)
        try:
            working = self.working.prepare(state, policy, now)
            self._accrue(now, working.shares.rates())
            working.shares.set_usage(self.usage)
            explaining = self.explaining(now)
            result = decide(working, policy, state.fleet_time(now), explain_pending=explaining)
        except BaseException:
            # Bringing the kept state up to date, or the core, stopped half-way through a
            # change (the notes of what changed are gone): rebuilt from scratch next time.
            self.working.invalidate()
            raise
        # Placed in the working set: looked at again next cycle, whether they go out or not.
        self.working.decided(result.placements)
        self.metrics.working_rebuilds.set(self.working.rebuilds)
        self.metrics.working_drifts.set(self.working.drifts)
        placements = [p for alloc in result.placements if (p := self._placement(alloc, epoch))]
        requests = [
            r for decision in result.preemptions for r in self._preemptions(decision, policy, epoch)
        ]
        if not explaining:
            return Decisions(
                epoch=epoch,
                at=now,
                placements=tuple(placements),
                requests=tuple(requests),
                pending=self.explained,
                explaining=False,
            )
        pending = dict(result.pending)
        pending.update(self._backoffs(now))
        limit = min(EXPLAIN_PER_CYCLE * (1 + self.owed), EXPLAIN_MOST)
        return Decisions(
            epoch=epoch,
            at=now,
            placements=tuple(placements),
            requests=tuple(requests),
            explained=tuple(self._explanations(pending, now, limit)),
            demand=self._demand(pending, epoch, now),
            pending=pending,
        )

    def explaining(self, now: float) -> bool:
        """Whether a cycle at `now` explains the waiting jobs (see EXPLAIN_GAP_S)."""
        return (
            len(self.state.pending) <= self.explain_always_up_to
            or not 0 <= now - self.explained_at < self.explain_gap_s
        )

    def explanation_due(self, now: float) -> bool:
        """Whether a cycle should run for the explanations alone: one since the last
        explaining cycle decided without them, and the gap has passed."""
        return self.owed > 0 and self.explaining(now)

    async def publish(self, decisions: Decisions) -> list[Outcome]:
        """Send the decisions; the outcome of each message, in `messages()` order."""
        out = decisions.messages()
        if not out:
            return []
        started = time.monotonic()
        if self.waiting is None:
            outcomes = await publish_each(self.broker, out)
        else:
            traced = self.waiting.placing(decisions)
            with traced:  # ended failed if the publish raises
                outcomes = await publish_each(self.broker, out)
                self.waiting.placed(traced, decisions, outcomes)
        took = time.monotonic() - started
        self.metrics.publish.observe(took)
        if took > 1.0:
            log.warning(
                "slow publish", seconds=round(took, 3), messages=len(out), epoch=decisions.epoch
            )
        return outcomes

    def apply(self, decisions: Decisions, outcomes: Sequence[Outcome]) -> int:
        """Apply what the broker acknowledged, exactly as the feed will when it reads it back
        (so reading it back changes nothing). The feed may have moved the state since deciding
        (a cancel, a capacity change, a refusal): the state's handlers skip what no longer
        applies and never raise for it. Returns the placements applied."""
        state = self.state
        ok = [exc is None for exc in outcomes]
        ends = (len(decisions.placements), len(decisions.placements) + len(decisions.requests))
        placed = 0
        for (message, event), sent in zip(decisions.placements, ok[: ends[0]], strict=True):
            if sent:
                self._observe_wait(event, decisions.at)
                state.on_placed(event, decisions.at)
                state.note_own(message.envelope.event_id, event.job_id)
                self.told.pop(JobId(event.job_id), None)
                placed += 1
        for (_, request), sent in zip(decisions.requests, ok[ends[0] : ends[1]], strict=True):
            if sent:
                state.on_preemption_requested(request)
                self.metrics.preemptions.labels(request.reason_code).inc()
        told_end = ends[1] + len(decisions.explained)
        for (_, job_id, told), sent in zip(
            decisions.explained, ok[ends[1] : told_end], strict=True
        ):
            if sent:
                self.told[job_id] = told
        if decisions.demand is not None and ok[told_end:] == [True]:
            self.demand_sent = (decisions.demand[1], decisions.at)
        if not decisions.explaining:
            self.owed += 1
        elif all(ok[ends[1] :]):
            # What was told is out: the next explanation is due a gap from now.
            self.explained_at, self.explained, self.owed = decisions.at, decisions.pending, 0
        for job_id in [j for j in self.told if j not in state.pending]:
            del self.told[job_id]
        self.metrics.placed.inc(placed)
        self.metrics.pending.set(len(state.pending))
        self.metrics.running.set(len(state.running))
        return placed

    def _observe_wait(self, event: PlacementDecided, at: float) -> None:
        """Submission to first placement; later attempts wait from a requeue, whose time the
        state does not keep, so they are left out."""
        queued = self.state.queued.get(JobId(event.job_id))
        if event.attempt != 1 or queued is None:
            return
        spec = event.spec
        waited = max(0.0, at - queued.submitted_at.timestamp())
        self.metrics.waited(spec.tenant, spec.queue, spec.priority_class, waited)

    def show_figures(self, decisions: Decisions) -> None:
        """The leader's gauges (figures.py), at most every FIGURES_EVERY_S: they walk every
        pending and running job, which a cycle under a burst need not pay for each time."""
        if decisions.at - self.figures_at < FIGURES_EVERY_S:
            return
        working = self.working.state
        if working is None:
            return
        self.figures_at = decisions.at
        try:
            if decisions.explaining or self.by_reason is None:
                self.by_reason = figures.pending_by_reason(self.state, decisions.pending)
            self.metrics.show(
                figures.jobs_by_state(self.state, decisions.at),
                self.by_reason,
                figures.tenant_figures(working, self._policy_for(decisions.at)),
                figures.fleet_figures(working.cap),
            )
        except Exception:  # a figure is never worth a cycle
            log.exception("scheduler figures failed")

    def _policy_for(self, now: float) -> Policy:
        """The policy with this month's budget deprioritizations applied to tenant weights."""
        month = datetime.fromtimestamp(now, UTC).strftime("%Y-%m")
        factors = self.state.weight_factors(month)
        if not factors:
            return self.policy
        key = (month, tuple(sorted(factors.items())))
        if self._weighted is not None and self._weighted[0] == key:
            return self._weighted[1]
        tenants = {
            name: replace(t, weight=t.weight * factors.get(name, 1.0))
            for name, t in self.policy.tenants.items()
        }
        weighted = replace(self.policy, tenants=tenants)
        self._weighted = (key, weighted)
        return weighted

    def _accrue(self, now: float, rates: Mapping[TenantId, float]) -> None:
        """Decayed past usage per tenant, in fleet (virtual) accelerator-seconds, from the
        accelerators each tenant holds now."""
        elapsed = 0.0 if self.last_accrual is None else max(0.0, now - self.last_accrual)
        self.last_accrual = now
        self.usage = accrue_rates(
            self.usage, rates, elapsed * self.time_scale, self.policy.fair_share.half_life_s
        )

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
        # Executors skip other clusters' placements by the `cluster` header, unparsed; by
        # `event_id` the leader knows its own placements when it reads them back and passes
        # them by unparsed (handlers._own).
        headers = (("cluster", str(alloc.cluster)), (OWN_HEADER, env.event_id))
        message = OutMessage(topics.PLACEMENT_DECIDED, job_id, env, headers=headers)
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
        """Why a requeued (or repeatedly refused) job backing off is not placed yet."""
        out = {}
        for job_id, until in self.state.backing_off(now).items():
            at = datetime.fromtimestamp(until, UTC).strftime("%H:%M:%S")
            since = self.state.closed.get(job_id, 0)
            refused = any(a > since for a, _ in self.state.refused.get(job_id, ()))
            why = "its placements were refused" if refused else "its last run ended"
            out[job_id] = PendingExplanation(
                codes=(ReasonCode.BACKING_OFF,),
                message=f"backing off after {why}; may be placed from {at} UTC",
            )
        return out

    def _demand(
        self, pending: Mapping[JobId, PendingExplanation], epoch: int, now: float
    ) -> tuple[OutMessage, tuple[object, ...]] | None:
        """The pending jobs that wait for capacity alone, head of the queue first, for the
        autoscaler: when that set (its jobs, their codes or requests) changes, at most every
        DEMAND_MIN_GAP_S, and every DEMAND_EVERY_S anyway (so an autoscaler that starts
        hears it soon)."""
        last = self.demand_sent
        if last is not None and now - last[1] < DEMAND_MIN_GAP_S:
            return None
        # Each job with its codes and its request (the state replaces a request that changes,
        # so a job back with more memory changes the signature; comparing an unchanged one
        # stops at its identity).
        waiting: list[tuple[JobId, tuple[str, ...], JobRequest]] = []
        for job_id, why in pending.items():
            codes = {str(c) for c in why.codes}
            job = self.state.pending.get(job_id)
            if job is None:
                continue
            if not codes & CAPACITY_CODES or codes & NOT_FOR_CAPACITY:
                continue
            waiting.append((job_id, tuple(sorted(codes)), job))
            if len(waiting) >= DEMAND_MAX:
                break
        signature = tuple(waiting)
        if not signature and (last is None or not last[0]):
            return None  # nothing waits for capacity, and nobody was told otherwise
        if last is not None and last[0] == signature and now - last[1] < DEMAND_EVERY_S:
            return None
        # Built only when it goes out: most cycles change nothing here.
        items = []
        built: dict[JobId, tuple[JobRequest, tuple[str, ...], DemandItem]] = {}
        for job_id, held_codes, job in waiting:
            cached = self._demand_items.get(job_id)
            if cached is not None and cached[0] is job and cached[1] == held_codes:
                items.append(cached[2])
                built[job_id] = cached
                continue
            try:
                item = DemandItem(
                    job_id=job_id,
                    tenant=job.tenant,
                    replicas=job.replicas,
                    accelerators=job.accelerators,
                    accelerator_types=list(job.accelerator_types),
                    accelerator_memory_gb=job.accelerator_memory_gb,
                    cpu=job.cpu,
                    memory_gb=job.memory_gb,
                    topology=job.topology.value,
                    topology_required=job.topology_required,
                    preemptible=job.preemptible,
                    codes=list(held_codes),
                )
            except ValidationError as error:
                # A job.queued no queue would have sent (written to the topic by hand): it
                # grows nothing, and it never stops a cycle.
                log.warning("job left out of the demand", job_id=job_id, error=str(error))
                continue
            items.append(item)
            built[job_id] = (job, held_codes, item)
        self._demand_items = built
        event = CapacityDemand(
            scheduler=self.leader,
            epoch=epoch,
            jobs=items,
            pending_jobs=len(pending),
            truncated=len(items) >= DEMAND_MAX,
        )
        env = envelope_for("CapacityDemand", event, producer=PRODUCER)
        return OutMessage(topics.CAPACITY_DEMAND, self.leader, env), signature

    def _explanations(
        self, pending: Mapping[JobId, PendingExplanation], now: float, limit: int
    ) -> list[tuple[OutMessage, JobId, Told]]:
        """A job's reason goes out when its codes change; a changed sentence with the same
        codes (e.g. "behind 12 jobs" becoming "behind 11") at most every EXPLAIN_EVERY_S; and
        at most `limit` in one cycle (see `worth_telling`). Each message comes with
        what its job will have been told once it is out."""
        out = []
        current = {j: why for j, why in pending.items() if j in self.state.pending}
        for job_id in worth_telling(current, self.told, now, limit):
            why = current[job_id]
            codes = tuple(str(c) for c in why.codes)
            event = PendingExplained(
                job_id=job_id, codes=list(codes), message=why.message, pending_jobs=len(pending)
            )
            tenant = self.state.pending[job_id].tenant
            env = envelope_for("PendingExplained", event, producer=PRODUCER, tenant=tenant)
            told: Told = (codes, why.message, now)
            out.append((OutMessage(topics.SCHEDULING_EXPLAINED, job_id, env), job_id, told))
        return out
