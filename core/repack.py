"""Repacking: moving a few small running jobs so that a waiting job that needs a whole node (or
more of one node than any has free) can start on capacity that is free but scattered.

At the end of a cycle the fleet may hold, across nodes, enough free accelerators of a type for
a job that waits, and no node with room for one of its replicas; once the small jobs that would
fill those fragments have run, the fragments stay idle until enough neighbours end on one node.
A repack asks a handful of running jobs on one node to checkpoint and restart elsewhere: it is
chosen only when, on a what-if copy of the books, the waiting job then fits *and* every moved
job fits again on what is left (so the move takes no capacity from anyone), and only for a job
that has waited `preemption.repack_after_s`. Each move costs its job a checkpoint and a restart
(`checkpoint_restart_s` in the simulator), which is why it is done for long waits only, moves
jobs smaller than one replica of the waiting job, and never moves a job of a higher priority
rank, one that is not preemptible, or one whose run is younger than `repack_after_s` (or
`min_runtime_s` if longer): a job is moved at most once per that much of its running.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from core.capacity import EPS, Capacity
from core.decisions import PreemptionDecision, Victim
from core.model import Allocation, JobId, JobRequest, NodeId
from core.placement import Plan, commit, find_placement, usable_candidates
from core.policy import Policy
from core.preemption import lost_work
from core.reasons import ReasonCode

# Nodes whose small jobs one repack may consider moving, best first.
NODES_TRIED = 16

# Reservation holds the waiting job may not use, and every hold of the cycle.
Holds = tuple[frozenset[int], frozenset[int]]


def repack(
    cap: Capacity,
    job: JobRequest,
    types: Iterable[str],
    on_node: Mapping[NodeId, Mapping[JobId, Allocation]],
    unavailable: frozenset[JobId] | set[JobId],
    policy: Policy,
    now: float,
    holds: Holds,
) -> PreemptionDecision | None:
    """Running jobs to move so that `job` (admitted on `types`) fits now, with every one of
    them fitting again elsewhere; None when no such small set exists. `unavailable` names jobs
    that may not move (already leaving, protected, or chosen as victims in this cycle).
    `holds`: the cycle's reservations `job` may not use, and all of them (a moved job is
    never counted on to backfill one)."""
    target = replace(job, accelerator_types=tuple(types))
    idx = usable_candidates(cap, target, policy.placement, holds[0])
    if idx.size == 0 or job.accelerators <= 0:
        return None
    free = cap.free_accelerators(idx)
    if float(free.sum()) + EPS < job.total_accelerators:
        return None  # moving jobs around makes no room that is not free already
    rank = policy.rank(job.priority_class)
    youngest = now - max(policy.preemption.min_runtime_s, policy.preemption.repack_after_s)

    def movable(alloc: Allocation) -> bool:
        other = alloc.job
        return (
            other.job_id not in unavailable
            and other.preemptible
            and alloc.start_time <= youngest
            and len(alloc.replicas) == 1
            and other.accelerators < job.accelerators
            and policy.rank(other.priority_class) <= rank
        )

    # Per node holding a fragment (some free, not enough for a replica; a node where one fits
    # missed for other reasons): what it lacks, and the cheapest of its small jobs to move.
    # Full nodes are left alone, so the pass costs what the fragments hold, not the fleet.
    fragments = (free > EPS) & (free < job.accelerators - EPS)
    options: list[tuple[float, int, list[Allocation]]] = []
    for node, has in zip(idx[fragments].tolist(), free[fragments].tolist(), strict=True):
        lacking = job.accelerators - has
        on = on_node.get(cap.nodes[node].node_id, {})
        movers = sorted(
            (a for a in on.values() if movable(a)),
            key=lambda a: (lost_work(a, now, policy), a.job.job_id),
        )
        chosen: list[Allocation] = []
        freed = 0.0
        for alloc in movers:
            if freed + EPS >= lacking:
                break
            chosen.append(alloc)
            freed += alloc.job.total_accelerators
        if freed + EPS >= lacking:
            cost = sum(lost_work(a, now, policy) for a in chosen)
            options.append((cost, node, chosen))
    options.sort(key=lambda o: (o[0], o[1]))

    tried = [chosen for _cost, _node, chosen in options[:NODES_TRIED]]
    if job.replicas == 1:
        # One node's small jobs make the room: each node on its own, cheapest first.
        for chosen in tried:
            if len(chosen) > policy.preemption.max_victims:
                continue
            decision = _attempt(cap, job, target, chosen, policy, now, holds)
            if decision is not None:
                return decision
        return None
    # A gang: the cheapest nodes together, until it fits.
    moved: list[Allocation] = []
    for k, chosen in enumerate(tried):
        moved.extend(chosen)
        if len(moved) > policy.preemption.max_victims:
            return None
        decision = _attempt(cap, job, target, moved, policy, now, holds)
        if decision is not None or k == len(tried) - 1:
            return decision
    return None


def _attempt(
    cap: Capacity,
    job: JobRequest,
    target: JobRequest,
    moved: list[Allocation],
    policy: Policy,
    now: float,
    holds: Holds,
) -> PreemptionDecision | None:
    """The decision if, with `moved` gone, `target` fits and then each of them fits again."""
    what_if = cap.copy()
    for alloc in moved:
        what_if.release(alloc.replicas, alloc.job)
    sensitivity = policy.priority(job.priority_class).cost_sensitivity
    plan = find_placement(what_if, target, policy.placement, sensitivity, holds[0], precise=False)
    if not isinstance(plan, Plan):
        return None
    commit(what_if, job, plan, now)
    if not _all_fit_again(what_if, moved, policy, now, holds[1]):
        return None
    return PreemptionDecision(
        job.job_id, tuple(_victim(a, job) for a in sorted(moved, key=_job_id))
    )


def _job_id(alloc: Allocation) -> JobId:
    return alloc.job.job_id


def _all_fit_again(
    what_if: Capacity, moved: list[Allocation], policy: Policy, now: float, holds: frozenset[int]
) -> bool:
    """Whether the moved jobs, largest first, each find a place on what is left, of the type
    each runs on now (so a move changes no tenant's quota standing)."""
    for alloc in sorted(moved, key=lambda a: (-a.job.total_accelerators, a.job.job_id)):
        node = what_if.index[alloc.replicas[0].node_id]
        same_type = (what_if.type_names[int(what_if.type_of[node])],)
        again = replace(alloc.job, accelerator_types=same_type)
        sensitivity = policy.priority(alloc.job.priority_class).cost_sensitivity
        plan = find_placement(what_if, again, policy.placement, sensitivity, holds, precise=False)
        if not isinstance(plan, Plan):
            return False
        commit(what_if, alloc.job, plan, now)
    return True


def _victim(alloc: Allocation, job: JobRequest) -> Victim:
    return Victim(
        alloc.job.job_id,
        ReasonCode.REPACKED,
        f"moved so that job {job.job_id}, waiting for {job.accelerators:g} accelerators on one "
        "node, can start on free capacity; there is room for it elsewhere and it resumes from "
        "its checkpoint",
    )
