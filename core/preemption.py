"""Preemption decisions (acting on them is the preemptor service's job): who may yield to whom,
and the smallest-loss set of victims that lets a pending job fit.

A job's claim is (priority rank, inside its nominal quota, -service level). A victim always has a
strictly lower claim than the job it makes room for, and the policy must allow that mechanism.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from core.capacity import Capacity
from core.decisions import Victim
from core.model import Allocation, JobRequest
from core.placement import Plan, find_placement
from core.policy import OrderingMode, Policy
from core.reasons import ReasonCode


@dataclass(frozen=True, order=True)
class Claim:
    rank: int
    guaranteed: bool
    # Negated service level: more attained service is a weaker claim.
    neg_level: int


def victim_reason(
    preemptor: Claim, victim: Claim, preemptor_job: JobRequest, policy: Policy
) -> ReasonCode | None:
    """Why `victim` may yield to `preemptor`, or None if it may not."""
    if not victim < preemptor:
        return None
    if victim.rank < preemptor.rank:
        may = policy.priority(preemptor_job.priority_class).preempting
        return ReasonCode.PREEMPTED_FOR_PRIORITY if may else None
    if victim.guaranteed != preemptor.guaranteed:
        return ReasonCode.RECLAIMED_BORROWED if policy.preemption.reclaim else None
    if policy.ordering is OrderingMode.LAS:
        return ReasonCode.PREEMPTED_ATTAINED_SERVICE
    return None


@dataclass(frozen=True)
class Candidate:
    alloc: Allocation
    claim: Claim
    reason: ReasonCode
    # Accelerator-seconds a preemption throws away (run time since start, plus a restart).
    lost_work: float


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
        what_if.release(cand.alloc.replicas)
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
            what_if.release(cand.alloc.replicas)
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
