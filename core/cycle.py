"""One scheduling cycle: snapshot in, decisions with reasons out. Pure and deterministic.

Phases, per pending job in policy order: admit (quota, cohort borrowing) -> place (topology,
scoring, holds) -> on a miss, hold capacity for a big gang and/or choose preemption victims ->
explain whatever is left.

A cycle that explains nothing (the simulator's) passes by groups of jobs it knows can only miss
without changing anything (`_Run.settled`); it makes exactly the decisions of one that explains.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from core.backfill import Reservation, may_backfill, reserve
from core.capacity import EPS
from core.decisions import CycleResult, PreemptionDecision, Victim
from core.fairshare import ShareBook
from core.model import Allocation, JobId, JobRequest, Snapshot, TenantId
from core.ordering import BORROWER_OFFSET, Group, in_order
from core.placement import (
    Plan,
    Shape,
    commit,
    explain_miss,
    find_placement,
    invalid_reason,
    shape_of,
)
from core.policy import BackfillMode, Policy
from core.preemption import VictimSearch, awaiting
from core.quota import Admission, QuotaBook
from core.reasons import Miss, PendingExplanation, ReasonCode, explain
from core.repack import repack
from core.service import Levels
from core.state import CycleState

__all__ = [
    "CycleResult",
    "CycleState",
    "PendingExplanation",
    "PreemptionDecision",
    "Victim",
    "decide",
    "schedule",
]

# A cycle's repack looks this far down the order, and tries this many jobs at most.
REPACK_SCAN = 64
REPACK_TRIES = 2

# Misses that mean "the fleet is busy", as opposed to quota or an impossible request.
CAPACITY_CODES = frozenset({ReasonCode.INSUFFICIENT_CAPACITY, ReasonCode.CAPACITY_RESERVED})


def schedule(
    snapshot: Snapshot,
    policy: Policy,
    now: float,
    rng: random.Random,
    levels: Levels | None = None,
) -> CycleResult:
    """Places what fits, in policy order, chooses victims where allowed, and explains the rest.

    `rng` is accepted so callers inject it; every tie is broken by a stable key instead.
    `levels` carries the learned history of service levels (core/service.py), if any.
    """
    del rng
    return decide(CycleState.from_snapshot(snapshot, policy, levels), policy, now)


def decide(
    state: CycleState, policy: Policy, now: float, *, explain_pending: bool = True
) -> CycleResult:
    """The cycle proper. With `explain_pending=False` the result carries no explanations, and
    the cycle passes by jobs whose miss is certain and changes nothing (the simulator's fast
    path); placements and preemptions are the same either way."""
    state.levels.refresh(now)
    state.queues.relevel(state.attained)
    run = _Run.start(state, policy, now, explain_pending)
    for job in in_order(state.queues, run.lane_share, None if explain_pending else run.settled):
        run.consider(job)
    if policy.preemption.enabled and policy.preemption.repack:
        run.repack()
    pending = run.explanations() if explain_pending else {}
    for alloc in run.placements:
        state.start(alloc)
    return CycleResult(
        placements=tuple(run.placements), preemptions=tuple(run.preemptions), pending=pending
    )


@dataclass
class _Run:
    state: CycleState
    policy: Policy
    now: float
    free_total: float
    victims: VictimSearch
    explaining: bool = True
    placements: list[Allocation] = field(default_factory=list)
    preemptions: list[PreemptionDecision] = field(default_factory=list)
    misses: dict[JobId, list[Miss]] = field(default_factory=dict)
    seen: list[JobRequest] = field(default_factory=list)
    memo: dict[tuple[Shape, frozenset[int]], Miss] = field(default_factory=dict)
    reservations: list[Reservation] = field(default_factory=list)
    head_of_line: JobRequest | None = None
    # Smallest per-replica amount a job asking for nothing else failed to get: no later job
    # asking for at least as much can fit. `_held` notes it failed while holds blocked it.
    failed_simple: float = float("inf")
    failed_simple_held: bool = False
    # Shapes (of jobs without a max runtime) that missed on placement: later ones miss too.
    missed_shapes: set[Shape] = field(default_factory=set)
    # Shapes no reservation could be made for: holds only grow, so none can be made later.
    unreservable: set[Shape] = field(default_factory=set)
    # Smallest amount a tenant was refused for a tuple of acceptable types: quota only tightens.
    refused: dict[tuple[TenantId, tuple[str, ...]], float] = field(default_factory=dict)
    _shares: dict[str, float] = field(default_factory=dict)
    # Quota's verdict per (tenant, acceptable types, amount) at the quota's version: with
    # thousands waiting behind a full fleet most jobs ask what the previous one asked.
    _verdicts: dict[tuple[TenantId, tuple[str, ...], float], tuple[int, list[Admission] | Miss]] = (
        field(default_factory=dict)
    )

    @classmethod
    def start(cls, state: CycleState, policy: Policy, now: float, explaining: bool) -> _Run:
        usable = state.cap.candidates((), None, True)
        # Holds last one cycle: a long-lived state must not keep the last cycle's reservations.
        state.cap.held.fill(-1)
        victims = VictimSearch(
            cap=state.cap,
            running=state.running,
            types_of=state.types_of,
            attained=state.attained,
            preempting=state.preempting,
            protected=state.protected,
            levels=state.levels,
            quota=state.quota,
            pending_ranks=frozenset(-tier[0] for tier in state.queues.lanes),
            policy=policy,
            now=now,
        )
        return cls(
            state=state,
            policy=policy,
            now=now,
            free_total=float(state.cap.free_accelerators(usable).sum()),
            victims=victims,
            explaining=explaining,
        )

    @property
    def quota(self) -> QuotaBook:
        return self.state.quota

    @property
    def shares(self) -> ShareBook:
        return self.state.shares

    @property
    def types_of(self) -> dict[JobId, str]:
        return self.state.types_of

    def lane_share(self, lane: str) -> float:
        """Tenants still inside their nominal quota go before tenants that could only borrow;
        otherwise a borrower would take back, at once, what reclaim just freed for a lender.
        A lane's share changes only when its own tenant is placed, so it is kept until then."""
        if not lane:
            return 0.0
        share = self._shares.get(lane)
        if share is None:
            tenant = TenantId(lane)
            borrowing_only = self.quota.at_nominal(tenant, self.state.cap.type_names)
            share = self.shares.share(tenant) + (BORROWER_OFFSET if borrowing_only else 0.0)
            self._shares[lane] = share
        return share

    def settled(self, group: Group) -> bool:
        """Whether every remaining job of `group` is certain to miss in this cycle without any
        effect on later jobs (no placement, hold, blocked line or victim search)."""
        if self.head_of_line is not None:
            return True
        shape = group.shape
        if group.tenant and shape.accelerators > 0:
            floor = self.refused.get((group.tenant, shape.accelerator_types))
            if floor is not None and shape.total_accelerators >= floor:
                return True
        if not self._quiet_miss(group):
            return False
        if shape.accelerators > 0 and self.free_total <= EPS:
            return True
        if shape.accelerators >= self.failed_simple and not (
            shape.bounded and self.failed_simple_held
        ):
            return True
        return not shape.bounded and shape in self.missed_shapes

    def _quiet_miss(self, group: Group) -> bool:
        """Whether a placement miss of this group's next job would leave the rest of the cycle
        as it is: no strict-FIFO block, no hold for a gang, no victim search."""
        shape = group.shape
        backfill = self.policy.backfill
        if backfill.mode is BackfillMode.OFF:
            return False
        if (
            backfill.mode is BackfillMode.RESERVE
            and shape.total_accelerators >= backfill.min_reserved_accelerators
            and len(self.reservations) < backfill.max_reservations
            and shape not in self.unreservable
        ):
            return False
        return not self.victims.may_search(group.tenant, group.priority_class, shape, group.level)

    def consider(self, job: JobRequest) -> None:
        if self.explaining:
            self.seen.append(job)
        if self.head_of_line is not None:
            self._miss(job, self._blocked_miss())
            return
        invalid = invalid_reason(job)
        if invalid is not None:
            self._miss(job, invalid)
            return
        admissions = self._admit(job)
        if isinstance(admissions, Miss):
            self._miss(job, admissions)
            return
        outcome = self._place(job, admissions)
        if isinstance(outcome, Miss):
            self._miss(job, outcome)
            self._after_capacity_miss(job, outcome, admissions)

    def _wanted_types(self, job: JobRequest) -> list[str]:
        present = self.state.cap.type_names
        if not job.accelerator_types:
            return present
        return [t for t in present if t in job.accelerator_types]

    def _admit(self, job: JobRequest) -> list[Admission] | Miss:
        key = (job.tenant, job.accelerator_types, job.total_accelerators)
        known = self._verdicts.get(key)
        if known is not None and known[0] == self.quota.version:
            return known[1]
        verdict = self._admit_afresh(job)
        self._verdicts[key] = (self.quota.version, verdict)
        return verdict

    def _admit_afresh(self, job: JobRequest) -> list[Admission] | Miss:
        wanted = self._wanted_types(job)
        if not wanted or job.accelerators <= 0:
            # Nothing to charge (no such type here, or no accelerator asked): placement explains.
            return [Admission(t, True) for t in wanted] or [Admission("", True)]
        verdicts = [self.quota.admit(job.tenant, t, job.total_accelerators) for t in wanted]
        admitted = [v for v in verdicts if isinstance(v, Admission)]
        if admitted:
            return admitted
        key = (job.tenant, job.accelerator_types)
        self.refused[key] = min(self.refused.get(key, float("inf")), job.total_accelerators)
        return next(v for v in verdicts if isinstance(v, Miss))

    def _place(self, job: JobRequest, admissions: list[Admission]) -> Allocation | Miss:
        shape = shape_of(job)
        restricted = len(admissions) < len(self._wanted_types(job))
        if restricted:
            # Quota rules out some acceptable types: search only where the tenant may run.
            shape = shape._replace(accelerator_types=tuple(a.accelerator_type for a in admissions))
        blocked = (
            frozenset(
                r.number
                for r in self.reservations
                if r.job_id != job.job_id and not may_backfill(job, r, self.now)
            )
            if self.reservations
            else frozenset()
        )
        outcome = self.memo.get((shape, blocked))
        if outcome is not None:
            return outcome
        target = replace(job, accelerator_types=shape.accelerator_types) if restricted else job
        prefs = self.policy.placement
        if job.total_accelerators > self.free_total + EPS:
            # Cheap when the fleet is full: skip the search, keep the precise explanation.
            plan = explain_miss(self.state.cap, target, prefs, blocked, self.explaining)
        else:
            sensitivity = self.policy.priority(job.priority_class).cost_sensitivity
            found = find_placement(
                self.state.cap, target, prefs, sensitivity, blocked, self.explaining
            )
            if not isinstance(found, Miss):
                return self._commit(job, found)
            plan = found
        # Capacity only shrinks within a cycle, so the same shape cannot fit later on.
        self.memo[(shape, blocked)] = plan
        if target is job and not shape.bounded:
            self.missed_shapes.add(shape)
        simple = _asks_nothing_else(target, prefs.spot_for_preemptible_only)
        if simple and plan.code in CAPACITY_CODES and job.accelerators < self.failed_simple:
            self.failed_simple = job.accelerators
            self.failed_simple_held = bool(blocked)
        return plan

    def _commit(self, job: JobRequest, plan: Plan) -> Allocation:
        cap = self.state.cap
        alloc = commit(cap, job, plan, self.now)
        accelerator_type = cap.type_names[int(cap.type_of[plan.nodes[0][0]])]
        self.types_of[job.job_id] = accelerator_type
        if job.accelerators > 0:
            self.quota.charge(job.tenant, accelerator_type, job.total_accelerators)
        self.shares.charge(job, accelerator_type)
        self.free_total -= job.total_accelerators
        self._shares.pop(job.tenant, None)
        self.placements.append(alloc)
        return alloc

    def _miss(self, job: JobRequest, miss: Miss) -> None:
        if self.explaining:
            self.misses.setdefault(job.job_id, []).append(miss)

    def _blocked_miss(self) -> Miss:
        head = self.head_of_line
        assert head is not None
        return Miss(
            ReasonCode.HEAD_OF_LINE_BLOCKED,
            f"strict FIFO: waiting for job {head.job_id} at the head of the queue to start",
        )

    def _after_capacity_miss(
        self, job: JobRequest, miss: Miss, admissions: list[Admission]
    ) -> None:
        if miss.code not in CAPACITY_CODES:
            return
        if self.policy.backfill.mode is BackfillMode.OFF:
            self.head_of_line = job
        elif self.policy.backfill.mode is BackfillMode.RESERVE:
            self._maybe_reserve(job)
        if self.victims.worth_trying(job, admissions):
            outcome = self.victims.attempt(job, admissions)
            if isinstance(outcome, PreemptionDecision):
                self.preemptions.append(outcome)
                count = len(outcome.victims)
                plural = "job" if count == 1 else "jobs"
                self._miss(job, awaiting(f"{count} lower-claim {plural} will make room"))
            elif outcome is not None:
                self._miss(job, outcome)

    def repack(self) -> None:
        """After every job was considered: if free capacity is left and a job that has waited
        `repack_after_s` would fit in it but for how it is scattered, move a few small jobs
        (core/repack.py). At most one repack per cycle, tried for the first jobs in order."""
        if self.free_total <= EPS:
            return
        after = self.policy.preemption.repack_after_s
        every_hold = frozenset(r.number for r in self.reservations)
        placed = {a.job.job_id for a in self.placements}
        placed.update(p.for_job for p in self.preemptions)
        tried = 0
        # Under strict FIFO only the head of the line may start, so only it is repacked for.
        head = self.head_of_line
        order = [head] if head else in_order(self.state.queues, self.lane_share, None)
        for scanned, job in enumerate(order):
            if scanned >= REPACK_SCAN or tried >= REPACK_TRIES:
                return
            waited = self.now - job.waiting_since
            if job.job_id in placed or waited < after or job.accelerators <= 0:
                continue
            if job.total_accelerators > self.free_total + EPS or invalid_reason(job):
                continue
            admissions = self._admit(job)
            if isinstance(admissions, Miss):
                continue
            tried += 1
            if self.victims.awaiting_victims(job):
                continue
            blocked = frozenset(
                r.number
                for r in self.reservations
                if r.job_id != job.job_id and not may_backfill(job, r, self.now)
            )
            unavailable = self.state.preempting | self.state.protected | self.victims.taken
            types = [a.accelerator_type for a in admissions]
            decision = repack(
                self.state.cap,
                job,
                types,
                self.state.on_node,
                unavailable,
                self.policy,
                self.now,
                (blocked, every_hold),
            )
            if decision is not None:
                self.victims.taken.update(v.job_id for v in decision.victims)
                self.preemptions.append(decision)
                count = len(decision.victims)
                plural = "job moves" if count == 1 else "jobs move"
                self._miss(job, awaiting(f"{count} smaller {plural} to pack its room"))
                return

    def _maybe_reserve(self, job: JobRequest) -> None:
        backfill = self.policy.backfill
        if job.total_accelerators < backfill.min_reserved_accelerators:
            return
        if len(self.reservations) >= backfill.max_reservations:
            return
        spot_ok = job.preemptible or not self.policy.placement.spot_for_preemptible_only
        # `state.on_node` is fixed while the cycle runs (placements join it at the end).
        on_node = self.state.on_node
        held = reserve(self.state.cap, job, len(self.reservations), on_node, spot_ok)
        if held is not None:
            self.reservations.append(held)
        else:
            self.unreservable.add(shape_of(job))

    def explanations(self) -> dict[JobId, PendingExplanation]:
        out: dict[JobId, PendingExplanation] = {}
        waiting_by_rank: dict[int, int] = {}
        seen = {j.job_id for j in self.seen}
        unseen = [j for j in self.state.queues.jobs() if j.job_id not in seen]
        for job in [*self.seen, *unseen]:
            misses = self.misses.get(job.job_id)
            if misses is None and job.job_id in seen:
                continue
            rank = self.policy.rank(job.priority_class)
            ahead = sum(n for r, n in waiting_by_rank.items() if r > rank)
            out[job.job_id] = explain(tuple(misses or ()), ahead)
            waiting_by_rank[rank] = waiting_by_rank.get(rank, 0) + 1
        return out


def _asks_nothing_else(job: JobRequest, spot_rule: bool) -> bool:
    """Whether a miss of `job` proves that no job asking for as many devices can fit."""
    return (
        job.accelerators >= 1
        and job.replicas == 1
        and not job.accelerator_types
        and job.accelerator_memory_gb is None
        and job.cpu <= 0
        and job.memory_gb <= 0
        and not job.excluded_nodes
        and (job.preemptible or not spot_rule)
    )
