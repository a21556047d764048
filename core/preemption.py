"""Preemption decisions (acting on them is the preemptor service's job): who may yield to whom,
the smallest-loss set of victims that lets a pending job fit, and one cycle's victim searches.

A job's claim is (priority rank, inside its nominal quota, -service level). A victim always has a
strictly lower claim than the job it makes room for, and the policy must allow that mechanism.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from core.capacity import EPS, Capacity
from core.decisions import PreemptionDecision, Victim
from core.model import Allocation, JobId, JobRequest, TenantId
from core.placement import Plan, Shape, find_placement
from core.policy import Policy
from core.quota import Admission, QuotaBook, guaranteed_jobs
from core.reasons import Miss, ReasonCode
from core.service import Levels


@dataclass(frozen=True, order=True)
class Claim:
    rank: int
    guaranteed: bool
    # Negated service level: more attained service is a weaker claim.
    neg_level: int


def victim_reason(
    preemptor: Claim,
    victim: Claim,
    preemptor_job: JobRequest,
    policy: Policy,
    service_gap: int,
) -> ReasonCode | None:
    """Why `victim` may yield to `preemptor`, or None if it may not; `service_gap`: how many
    levels above the preemptor's a victim's service level alone is a reason (0: never)."""
    if not victim < preemptor:
        return None
    if victim.rank < preemptor.rank:
        may = policy.priority(preemptor_job.priority_class).preempting
        return ReasonCode.PREEMPTED_FOR_PRIORITY if may else None
    if victim.guaranteed != preemptor.guaranteed:
        return ReasonCode.RECLAIMED_BORROWED if policy.preemption.reclaim else None
    if service_gap and victim.neg_level + service_gap <= preemptor.neg_level:
        return ReasonCode.PREEMPTED_ATTAINED_SERVICE
    return None


@dataclass(frozen=True)
class Candidate:
    alloc: Allocation
    claim: Claim
    reason: ReasonCode
    # Accelerator-seconds a preemption throws away (run time since start, plus a restart).
    lost_work: float


@dataclass
class VictimPool:
    """The running jobs that may yield in this cycle, bucketed by accelerator type and claim.

    Claims are computed once per cycle and lost work only for jobs that turn out to be
    candidates, so a victim search looks at the buckets below the preemptor's claim only.
    """

    by_type: dict[str, dict[Claim, list[Allocation]]] = field(default_factory=dict)
    # How many levels lower a job must be to take a running job's place for service alone
    # (0: never; `Levels.preempt_gap`).
    service_gap: int = 0
    # Highest level among the pool's jobs per priority rank (worked out when first asked).
    levels_by_rank: dict[int, int] | None = None

    @classmethod
    def build(
        cls,
        running: Mapping[JobId, Allocation],
        types_of: Mapping[JobId, str],
        attained: Mapping[JobId, float],
        guaranteed: Mapping[JobId, bool],
        excluded: frozenset[JobId],
        now: float,
        policy: Policy,
        levels: Levels | None = None,
    ) -> VictimPool:
        """`excluded` names jobs already ordered to yield; jobs younger than
        `preemption.min_runtime_s` and non-preemptible jobs never enter the pool."""
        youngest_start = now - policy.preemption.min_runtime_s
        levels = levels or Levels(policy)
        by_level = levels.active and bool(attained)
        # (type, priority class, guaranteed, level) -> jobs; claims are made once per bucket.
        buckets: dict[tuple[str, str, bool, int], list[Allocation]] = {}
        for job_id, alloc in running.items():
            job = alloc.job
            if alloc.start_time > youngest_start or not job.preemptible or job_id in excluded:
                continue
            accelerator_type = types_of.get(job_id)
            if accelerator_type is None:
                continue
            level = levels.level(job, attained.get(job_id, 0.0)) if by_level else 0
            key = (accelerator_type, job.priority_class, guaranteed.get(job_id, True), level)
            bucket = buckets.get(key)
            if bucket is None:
                buckets[key] = [alloc]
            else:
                bucket.append(alloc)
        pool = cls(service_gap=levels.preempt_gap)
        for (accelerator_type, priority_class, inside, level), allocs in buckets.items():
            claim = Claim(policy.rank(priority_class), inside, -level)
            by_claim = pool.by_type.setdefault(accelerator_type, {})
            by_claim.setdefault(claim, []).extend(allocs)
        return pool

    def candidates(
        self,
        preemptor: Claim,
        job: JobRequest,
        accelerator_type: str,
        taken: Iterable[JobId],
        now: float,
        policy: Policy,
    ) -> list[Candidate]:
        """Jobs of `accelerator_type` that may yield to `job`, minus those already `taken`."""
        skip = set(taken)
        out: list[Candidate] = []
        for claim, allocs in self.by_type.get(accelerator_type, {}).items():
            reason = victim_reason(preemptor, claim, job, policy, self.service_gap)
            if reason is None:
                continue
            out.extend(
                Candidate(a, claim, reason, lost_work(a, now, policy))
                for a in allocs
                if a.job.job_id not in skip
            )
        return out


def lost_work(alloc: Allocation, now: float, policy: Policy) -> float:
    elapsed = max(0.0, now - alloc.start_time) + policy.preemption.checkpoint_restart_s
    return alloc.job.total_accelerators * elapsed


def choose_victims(
    cap: Capacity,
    job: JobRequest,
    candidates: Iterable[Candidate],
    policy: Policy,
    cost_sensitivity: float,
) -> tuple[Victim, ...] | None:
    """The victims to preempt so `job` fits, least work lost first; None if no set suffices.

    Greedy: release the cheapest candidates on a what-if copy until the job fits, then put back
    every victim (most expensive first) whose capacity turns out not to be needed.
    """
    ordered = sorted(candidates, key=lambda c: (c.lost_work, c.claim, c.alloc.job.job_id))
    if not ordered:
        return None
    what_if = cap.copy()
    chosen: list[Candidate] = []
    for cand in ordered[: policy.preemption.max_victims]:
        what_if.release(cand.alloc.replicas, cand.alloc.job)
        chosen.append(cand)
        if _fits(what_if, job, policy, cost_sensitivity):
            break
    else:
        return None
    for cand in sorted(chosen, key=lambda c: (-c.lost_work, c.alloc.job.job_id)):
        what_if.charge([cand.alloc])
        if _fits(what_if, job, policy, cost_sensitivity):
            chosen.remove(cand)
        else:
            what_if.release(cand.alloc.replicas, cand.alloc.job)
    return tuple(_victim(c, job) for c in sorted(chosen, key=lambda c: c.alloc.job.job_id))


def _fits(cap: Capacity, job: JobRequest, policy: Policy, cost_sensitivity: float) -> bool:
    return isinstance(find_placement(cap, job, policy.placement, cost_sensitivity), Plan)


def _victim(cand: Candidate, job: JobRequest) -> Victim:
    words = {
        ReasonCode.PREEMPTED_FOR_PRIORITY: (
            f"preempted for higher-priority job {job.job_id} ({job.priority_class})"
        ),
        ReasonCode.RECLAIMED_BORROWED: (
            f"ran on capacity borrowed from the cohort, reclaimed for {job.tenant}'s "
            f"job {job.job_id} which is within its quota"
        ),
        ReasonCode.PREEMPTED_ATTAINED_SERVICE: (
            f"has received more service than job {job.job_id}; it resumes from its checkpoint"
        ),
    }
    return Victim(cand.alloc.job.job_id, cand.reason, words.get(cand.reason, "preempted"))


# Victim searches are the expensive part of a cycle; the best-ordered few jobs get one.
ATTEMPTS_PER_CYCLE = 4


@dataclass
class VictimSearch:
    """One cycle's victim searches: at most `ATTEMPTS_PER_CYCLE`, never the same victim for two
    jobs, and none for a job that the victims already leaving would make room for."""

    cap: Capacity
    running: Mapping[JobId, Allocation]
    types_of: Mapping[JobId, str]
    attained: Mapping[JobId, float]
    preempting: frozenset[JobId]
    quota: QuotaBook
    # Priority ranks that have pending jobs this cycle.
    pending_ranks: frozenset[int]
    policy: Policy
    now: float
    # Never victims in this cycle, though not leaving (the preemptor declined them).
    protected: frozenset[JobId] = frozenset()
    levels: Levels | None = None
    attempts: int = 0
    taken: set[JobId] = field(default_factory=set)
    _pool: VictimPool | None = None
    _priority_possible: bool | None = None
    _lowest_rank: int | None = None
    _borrowing: bool | None = None
    _exhausted: bool | None = None

    def __post_init__(self) -> None:
        if self.levels is None:
            self.levels = Levels(self.policy)

    @property
    def _by_service(self) -> bool:
        return self.levels is not None and self.levels.preempt_gap > 0

    def _service_victims_above(self, rank: int, level: int) -> bool:
        """Whether a running job of `rank` is far enough above `level` to yield for service."""
        assert self.levels is not None
        return self._highest_level(rank) >= level + self.levels.preempt_gap

    def exhausted(self) -> bool:
        """Whether no job can get a victim search in the rest of this cycle."""
        if self._exhausted is None:
            self._exhausted = (
                not self.policy.preemption.enabled
                or self.attempts >= ATTEMPTS_PER_CYCLE
                or not self._possible()
            )
        return self._exhausted

    def _possible(self) -> bool:
        """Cheap test that some running job could ever be a victim in this cycle."""
        if self._by_service and self.running:
            return True  # `worth_trying` asks, per job, whether some level is above its own
        if self._priority_possible is None:
            preempting = {pc.rank for pc in self.policy.priority_classes.values() if pc.preempting}
            ranks = self.pending_ranks & preempting
            self._priority_possible = bool(ranks) and max(ranks) > self._lowest_running_rank()
        if self._priority_possible:
            return True
        return self.policy.preemption.reclaim and self._anyone_borrowing()

    def may_search(
        self, group_tenant: TenantId, priority_class: str, shape: Shape, level: int = 0
    ) -> bool:
        """Whether some job of this kind (at service `level`) could still get a victim search
        in this cycle (a cheap over-approximation of `worth_trying`; `group_tenant` "" stands
        for any)."""
        if self.exhausted():
            return False
        if self._by_service and self._service_victims_above(
            self.policy.rank(priority_class), level
        ):
            return True
        if self.policy.priority(priority_class).preempting and (
            self._lowest_running_rank() < self.policy.rank(priority_class)
        ):
            return True
        if not (self.policy.preemption.reclaim and self._anyone_borrowing()):
            return False
        if not group_tenant or shape.accelerators <= 0:
            return True
        # Reclaim needs a job within its tenant's nominal quota; usage only grows in a cycle.
        types = shape.accelerator_types or tuple(self.cap.type_names)
        return self.quota.may_guarantee(group_tenant, types, shape.total_accelerators)

    def worth_trying(self, job: JobRequest, admissions: list[Admission]) -> bool:
        if self.exhausted():
            return False
        rank = self.policy.rank(job.priority_class)
        if self._by_service:
            # Only a running job of the same rank far enough above it can yield for service; a
            # job that has none must not use up the cycle's searches (reclaim needs them).
            assert self.levels is not None
            level = self.levels.level(job, self.attained.get(job.job_id, 0.0))
            if self._service_victims_above(rank, level):
                return True
        if self.policy.priority(job.priority_class).preempting and (
            self._lowest_running_rank() < rank
        ):
            return True
        guaranteed = any(a.guaranteed for a in admissions)
        return self.policy.preemption.reclaim and guaranteed and self._anyone_borrowing()

    def _highest_level(self, rank: int) -> int:
        """The highest service level of a job that may be a victim, at `rank`; -1 when there is
        none. Built once per cycle with the pool, which a search would build anyway."""
        pool = self._victim_pool()
        if pool.levels_by_rank is None:
            by_rank: dict[int, int] = {}
            for by_claim in pool.by_type.values():
                for claim in by_claim:
                    by_rank[claim.rank] = max(by_rank.get(claim.rank, -1), -claim.neg_level)
            pool.levels_by_rank = by_rank
        return pool.levels_by_rank.get(rank, -1)

    def _lowest_running_rank(self) -> int:
        if self._lowest_rank is None:
            ranks = (self.policy.rank(a.job.priority_class) for a in self.running.values())
            self._lowest_rank = min(ranks, default=1 << 30)
        return self._lowest_rank

    def _anyone_borrowing(self) -> bool:
        if self._borrowing is None:
            used = list(self.quota.used)
            self._borrowing = any(self.quota.borrowing(t, ty) > EPS for t, ty in used)
        return self._borrowing

    def attempt(
        self, job: JobRequest, admissions: list[Admission]
    ) -> PreemptionDecision | Miss | None:
        """Victims that let `job` fit, a miss saying it waits for victims already leaving, or
        None when no set of lower-claim jobs would do."""
        self.attempts += 1
        self._exhausted = None
        if self.awaiting_victims(job):
            return awaiting("victims chosen earlier are still leaving")
        assert self.levels is not None
        level = self.levels.level(job, self.attained.get(job.job_id, 0.0))
        sensitivity = self.policy.priority(job.priority_class).cost_sensitivity
        for adm in admissions:
            claim = Claim(self.policy.rank(job.priority_class), adm.guaranteed, -level)
            candidates = self._victim_pool().candidates(
                claim, job, adm.accelerator_type, self.taken, self.now, self.policy
            )
            target = replace(job, accelerator_types=(adm.accelerator_type,))
            victims = choose_victims(self.cap, target, candidates, self.policy, sensitivity)
            if victims:
                self.taken.update(v.job_id for v in victims)
                return PreemptionDecision(job.job_id, victims)
        return None

    def _victim_pool(self) -> VictimPool:
        if self._pool is None:
            self._pool = VictimPool.build(
                self.running,
                self.types_of,
                self.attained,
                guaranteed_jobs(self.running, self.types_of, self.policy),
                self.preempting | self.protected,
                self.now,
                self.policy,
                self.levels,
            )
        return self._pool

    def awaiting_victims(self, job: JobRequest) -> bool:
        """Whether the jobs already leaving would make room for `job`."""
        leaving = [self.running[j] for j in self.preempting if j in self.running]
        if not leaving:
            return False
        what_if = self.cap.copy()
        for alloc in leaving:
            what_if.release(alloc.replicas, alloc.job)
        sensitivity = self.policy.priority(job.priority_class).cost_sensitivity
        return isinstance(find_placement(what_if, job, self.policy.placement, sensitivity), Plan)


def awaiting(detail: str) -> Miss:
    return Miss(ReasonCode.AWAITING_PREEMPTION, f"waiting for preemption: {detail}")
