"""One scheduling cycle: snapshot in, decisions with reasons out. Pure and deterministic.

Phases, per pending job in policy order: admit (quota, cohort borrowing) -> place (topology,
scoring, holds) -> on a miss, hold capacity for a big gang and/or choose preemption victims ->
explain whatever is left.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from core.backfill import Reservation, may_backfill, reserve
from core.capacity import EPS, Capacity
from core.decisions import CycleResult, PreemptionDecision, Victim
from core.fairshare import ShareBook
from core.model import Allocation, JobId, JobRequest, NodeId, Snapshot, TenantId
from core.ordering import PendingQueues, in_order, service_level
from core.placement import Plan, commit, explain_miss, find_placement, invalid_reason
from core.policy import BackfillMode, OrderingMode, Policy
from core.preemption import Candidate, Claim, choose_victims, lost_work, victim_reason
from core.quota import Admission, QuotaBook, guaranteed_jobs
from core.reasons import Miss, PendingExplanation, ReasonCode, explain

__all__ = [
    "CycleResult",
    "CycleState",
    "PendingExplanation",
    "PreemptionDecision",
    "Victim",
    "decide",
    "schedule",
]

# Misses that mean "the fleet is busy", as opposed to quota or an impossible request.
CAPACITY_CODES = frozenset({ReasonCode.INSUFFICIENT_CAPACITY, ReasonCode.CAPACITY_RESERVED})
# Victim searches are the expensive part of a cycle; the best-ordered few jobs get one.
PREEMPTION_ATTEMPTS_PER_CYCLE = 4
# Added to the share of a tenant with no nominal quota left: larger than any real share.
BORROWER_OFFSET = 1e6


@dataclass
class CycleState:
    """The working set a cycle decides on, kept consistent by `decide` (placements become
    running) and `release` (work leaves). The live scheduler builds one per cycle from a
    snapshot; the simulator keeps one for the whole replay and updates it incrementally."""

    cap: Capacity
    running: dict[JobId, Allocation]
    queues: PendingQueues
    quota: QuotaBook
    shares: ShareBook
    # Accelerator type each running job occupies (quota and fair share are kept per type).
    types_of: dict[JobId, str]
    attained: Mapping[JobId, float] = field(default_factory=dict)
    preempting: frozenset[JobId] = frozenset()

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, policy: Policy) -> CycleState:
        cap = Capacity.build(snapshot.nodes, snapshot.clusters, policy.prices)
        cap.charge(snapshot.running.values())
        types_of = {
            job_id: cap.type_names[int(cap.type_of[cap.index[a.replicas[0].node_id]])]
            for job_id, a in sorted(snapshot.running.items())
            if a.replicas and a.replicas[0].node_id in cap.index
        }
        typed = [(snapshot.running[j], t) for j, t in types_of.items()]
        return cls(
            cap=cap,
            running=dict(snapshot.running),
            queues=PendingQueues.build(snapshot.pending, policy, snapshot.attained),
            quota=QuotaBook.build(typed, policy),
            shares=ShareBook.build(cap, typed, snapshot.usage, policy),
            types_of=types_of,
            attained=snapshot.attained,
            preempting=snapshot.preempting,
        )

    def release(self, job_id: JobId) -> Allocation:
        """Takes a running job out (finished, failed or preempted) and frees what it held."""
        alloc = self.running.pop(job_id)
        self.cap.release(alloc.replicas)
        accelerator_type = self.types_of.pop(job_id, None)
        if accelerator_type is not None:
            if alloc.job.accelerators > 0:
                self.quota.charge(alloc.job.tenant, accelerator_type, -alloc.job.total_accelerators)
            self.shares.charge(alloc.job, accelerator_type, sign=-1.0)
        return alloc


def schedule(snapshot: Snapshot, policy: Policy, now: float, rng: random.Random) -> CycleResult:
    """Places what fits, in policy order, chooses victims where allowed, and explains the rest.

    `rng` is accepted so callers inject it; every tie is broken by a stable key instead.
    """
    del rng
    return decide(CycleState.from_snapshot(snapshot, policy), policy, now)


def decide(
    state: CycleState, policy: Policy, now: float, *, explain_pending: bool = True
) -> CycleResult:
    """The cycle proper. With `explain_pending=False` the result carries no explanations and
    the cycle may stop as soon as nothing more can start (the simulator's fast path)."""
    run = _Run.start(state, policy, now)
    for job in in_order(state.queues, run.lane_share):
        run.consider(job)
        if not explain_pending and run.saturated():
            break
    pending = run.explanations() if explain_pending else {}
    for alloc in run.placements:
        state.queues.remove(alloc.job)
        state.running[alloc.job.job_id] = alloc
    return CycleResult(
        placements=tuple(run.placements), preemptions=tuple(run.preemptions), pending=pending
    )


@dataclass
class _Run:
    state: CycleState
    policy: Policy
    now: float
    free_total: float
    placements: list[Allocation] = field(default_factory=list)
    preemptions: list[PreemptionDecision] = field(default_factory=list)
    misses: dict[JobId, list[Miss]] = field(default_factory=dict)
    seen: list[JobRequest] = field(default_factory=list)
    memo: dict[tuple[object, ...], Miss] = field(default_factory=dict)
    reservations: list[Reservation] = field(default_factory=list)
    taken_victims: set[JobId] = field(default_factory=set)
    attempts: int = 0
    head_of_line: JobRequest | None = None
    # Smallest per-replica amount a job asking for nothing else failed to get: no later job
    # asking for at least as much can fit. `_held` notes it failed while holds blocked it.
    failed_simple: float = float("inf")
    failed_simple_held: bool = False
    # Per-replica amounts of the jobs this cycle has not looked at yet.
    unseen_sizes: Counter[float] = field(default_factory=Counter)
    _borrowing: bool | None = None
    _priority_preemption_possible: bool | None = None
    _guaranteed: Mapping[JobId, bool] | None = None
    _lowest_rank: int | None = None

    @classmethod
    def start(cls, state: CycleState, policy: Policy, now: float) -> _Run:
        usable = state.cap.candidates((), None, True)
        return cls(
            state=state,
            policy=policy,
            now=now,
            free_total=float(state.cap.free_accelerators(usable).sum()),
            unseen_sizes=Counter(state.queues.sizes),
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
        otherwise a borrower would take back, at once, what reclaim just freed for a lender."""
        if not lane:
            return 0.0
        tenant = TenantId(lane)
        borrowing_only = self.quota.at_nominal(tenant, self.state.cap.type_names)
        return self.shares.share(tenant) + (BORROWER_OFFSET if borrowing_only else 0.0)

    def saturated(self) -> bool:
        """Nothing later in the order can start or trigger anything in this cycle."""
        if self.head_of_line is not None:
            return True
        queues = self.state.queues
        smallest = min((k for k, n in self.unseen_sizes.items() if n > 0), default=float("inf"))
        if smallest <= 0:
            return False
        dominated = smallest >= self.failed_simple and (
            not self.failed_simple_held or queues.bounded_runtime_jobs == 0
        )
        if self.free_total > EPS and not dominated:
            return False
        preempt_left = (
            self.policy.preemption.enabled
            and self.attempts < PREEMPTION_ATTEMPTS_PER_CYCLE
            and self._preemption_possible()
        )
        return not preempt_left

    def _preemption_possible(self) -> bool:
        """Cheap test that some running job could ever be a victim in this cycle."""
        if self.policy.ordering is OrderingMode.LAS:
            return bool(self.state.running)
        if self._priority_preemption_possible is None:
            lanes = self.state.queues.lanes
            pending_ranks = {-tier[0] for tier, by_lane in lanes.items() if any(by_lane.values())}
            preempting = {pc.rank for pc in self.policy.priority_classes.values() if pc.preempting}
            lowest = self._lowest_running_rank()
            self._priority_preemption_possible = any(r > lowest for r in pending_ranks & preempting)
        if self._priority_preemption_possible:
            return True
        return self.policy.preemption.reclaim and self._anyone_borrowing()

    def _could_preempt(self, job: JobRequest, admissions: list[Admission]) -> bool:
        if self.policy.ordering is OrderingMode.LAS:
            return bool(self.state.running)
        rank = self.policy.rank(job.priority_class)
        if self.policy.priority(job.priority_class).preempting and (
            self._lowest_running_rank() < rank
        ):
            return True
        guaranteed = any(a.guaranteed for a in admissions)
        return self.policy.preemption.reclaim and guaranteed and self._anyone_borrowing()

    def _lowest_running_rank(self) -> int:
        if self._lowest_rank is None:
            ranks = (self.policy.rank(a.job.priority_class) for a in self.state.running.values())
            self._lowest_rank = min(ranks, default=1 << 30)
        return self._lowest_rank

    def _anyone_borrowing(self) -> bool:
        # Victims are running jobs, so borrowing as of the cycle's start is what counts.
        if self._borrowing is None:
            used = list(self.quota.used)
            self._borrowing = any(self.quota.borrowing(t, ty) > EPS for t, ty in used)
        return self._borrowing

    def consider(self, job: JobRequest) -> None:
        self.seen.append(job)
        self.unseen_sizes[job.accelerators] -= 1
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
        wanted = self._wanted_types(job)
        if not wanted or job.accelerators <= 0:
            # Nothing to charge (no such type here, or no accelerator asked): placement explains.
            return [Admission(t, True) for t in wanted] or [Admission("", True)]
        verdicts = [self.quota.admit(job.tenant, t, job.total_accelerators) for t in wanted]
        admitted = [v for v in verdicts if isinstance(v, Admission)]
        if admitted:
            return admitted
        return next(v for v in verdicts if isinstance(v, Miss))

    def _place(self, job: JobRequest, admissions: list[Admission]) -> Allocation | Miss:
        target = job
        if len(admissions) < len(self._wanted_types(job)):
            # Quota rules out some acceptable types: search only where the tenant may run.
            target = replace(job, accelerator_types=tuple(a.accelerator_type for a in admissions))
        blocked = frozenset(
            r.number
            for r in self.reservations
            if r.job_id != job.job_id and not may_backfill(job, r, self.now)
        )
        key = _shape_key(target, blocked)
        outcome = self.memo.get(key)
        if outcome is not None:
            return outcome
        prefs = self.policy.placement
        if job.total_accelerators > self.free_total + EPS:
            # Cheap when the fleet is full: skip the search, keep the precise explanation.
            plan: Plan | Miss = explain_miss(self.state.cap, target, prefs, blocked)
        else:
            sensitivity = self.policy.priority(job.priority_class).cost_sensitivity
            plan = find_placement(self.state.cap, target, prefs, sensitivity, blocked)
        if isinstance(plan, Plan):
            return self._commit(job, plan)
        # Capacity only shrinks within a cycle, so the same shape cannot fit later on.
        self.memo[key] = plan
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
        self.placements.append(alloc)
        return alloc

    def _miss(self, job: JobRequest, miss: Miss) -> None:
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
        if (
            self.policy.preemption.enabled
            and self.attempts < PREEMPTION_ATTEMPTS_PER_CYCLE
            and self._could_preempt(job, admissions)
        ):
            self._maybe_preempt(job, admissions)

    def _maybe_reserve(self, job: JobRequest) -> None:
        backfill = self.policy.backfill
        if job.total_accelerators < backfill.min_reserved_accelerators:
            return
        if len(self.reservations) >= backfill.max_reservations:
            return
        running_on: dict[NodeId, list[Allocation]] = {}
        for alloc in self.state.running.values():
            for node_id in {r.node_id for r in alloc.replicas}:
                running_on.setdefault(node_id, []).append(alloc)
        spot_ok = job.preemptible or not self.policy.placement.spot_for_preemptible_only
        held = reserve(self.state.cap, job, len(self.reservations), running_on, spot_ok)
        if held is not None:
            self.reservations.append(held)

    def _maybe_preempt(self, job: JobRequest, admissions: list[Admission]) -> None:
        self.attempts += 1
        if self._awaiting_victims(job):
            self._miss(job, _awaiting("victims chosen earlier are still leaving"))
            return
        level = service_level(self.state.attained.get(job.job_id, 0.0), self.policy)
        sensitivity = self.policy.priority(job.priority_class).cost_sensitivity
        for adm in admissions:
            claim = Claim(self.policy.rank(job.priority_class), adm.guaranteed, -level)
            candidates = self._candidates(job, claim, adm.accelerator_type)
            target = replace(job, accelerator_types=(adm.accelerator_type,))
            victims = choose_victims(self.state.cap, target, candidates, self.policy, sensitivity)
            if victims:
                self.preemptions.append(PreemptionDecision(job.job_id, victims))
                self.taken_victims.update(v.job_id for v in victims)
                plural = "job" if len(victims) == 1 else "jobs"
                self._miss(job, _awaiting(f"{len(victims)} lower-claim {plural} will make room"))
                return

    def _awaiting_victims(self, job: JobRequest) -> bool:
        leaving = [self.state.running[j] for j in self.state.preempting if j in self.state.running]
        if not leaving:
            return False
        what_if = self.state.cap.copy()
        for alloc in leaving:
            what_if.release(alloc.replicas)
        sensitivity = self.policy.priority(job.priority_class).cost_sensitivity
        return isinstance(find_placement(what_if, job, self.policy.placement, sensitivity), Plan)

    def _candidates(self, job: JobRequest, claim: Claim, accelerator_type: str) -> list[Candidate]:
        if self._guaranteed is None:
            running = self.state.running
            typed = [(running[j], t) for j, t in sorted(self.types_of.items()) if j in running]
            self._guaranteed = guaranteed_jobs(typed, self.policy)
        out = []
        min_runtime = self.policy.preemption.min_runtime_s
        for job_id, alloc in self.state.running.items():
            victim = alloc.job
            if (
                not victim.preemptible
                or job_id in self.taken_victims
                or job_id in self.state.preempting
                or self.types_of.get(job_id) != accelerator_type
                or self.now - alloc.start_time < min_runtime
            ):
                continue
            level = service_level(self.state.attained.get(job_id, 0.0), self.policy)
            theirs = Claim(
                self.policy.rank(victim.priority_class), self._guaranteed.get(job_id, True), -level
            )
            reason = victim_reason(claim, theirs, job, self.policy)
            if reason is not None:
                out.append(
                    Candidate(alloc, theirs, reason, lost_work(alloc, self.now, self.policy))
                )
        return out

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


def _awaiting(detail: str) -> Miss:
    return Miss(ReasonCode.AWAITING_PREEMPTION, f"waiting for preemption: {detail}")


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


def _shape_key(job: JobRequest, blocked: frozenset[int]) -> tuple[object, ...]:
    return (
        job.accelerators,
        job.replicas,
        job.accelerator_types,
        job.accelerator_memory_gb,
        job.cpu,
        job.memory_gb,
        job.topology,
        job.topology_required,
        job.preemptible,
        job.kind,
        job.excluded_nodes,
        blocked,
    )
