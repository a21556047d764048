"""The working set the leader's core decides on, kept from cycle to cycle and brought up to date
by what changed, as the simulator keeps its own; no longer rebuilt from a snapshot each cycle.

Building a `CycleState` from the scheduler's state costs time in proportion to the fleet and
to the running work (the node arrays, then charging every running allocation): measured on a
1,213-node fleet, 12 ms with nothing running and 150 ms with 9,600 allocations, for every
cycle, even one that places a single job. Kept instead, each cycle costs what changed since the
last one: the jobs `SchedulerState` notes in `touched` (its `pending`, `running` and `held`
dicts note every write) and the decisions the last cycle made, whether or not they went out.

It is rebuilt from a snapshot when the fleet changes (a node added, removed or changed, a
health verdict: `fleet_version`), when the policy the core decides with changes (budget
weights at a month's turn or a deprioritization), after a cycle that raised half-way, and, as
a check that nothing drifted, every `verify_every` cycles: then the kept state is compared with
the rebuilt one, and a difference is logged and counted (and the rebuilt one kept).

Placements name the devices each replica takes, so the kept state and a rebuild charge the same
devices (`core.capacity.Capacity.charge`): the check compares free capacity per node and each
device's use. Only a placement that names no devices (from a leader of an older version) is
packed by rule, which may differ between the two; that is logged as a drift and rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import structlog

from core.capacity import EPS
from core.cycle import CycleState
from core.model import Allocation, JobId, JobRequest, TenantId
from core.ordering import tier_of
from core.policy import Policy
from core.service import Levels
from services.scheduler.state import SchedulerState

log = structlog.get_logger()
# Notes of changed jobs kept for a cycle to come: beyond this a rebuild is cheaper.
MAX_TOUCHED = 100_000


class WorkingSetDrift(AssertionError):
    """The kept working set differs from one rebuilt from the same state (strict mode)."""


@dataclass
class WorkingSet:
    """`prepare` returns the state to decide on; `decided` names the jobs a cycle placed, so
    the next `prepare` looks at them again whatever became of their messages."""

    verify_every: int = 0
    # Raise on a difference instead of repairing it (tests run with a check every cycle).
    strict: bool = False
    state: CycleState | None = None
    rebuilds: int = 0
    drifts: int = 0
    # What is in the core's queues, by job (the queues need the request to remove it).
    _queued: dict[JobId, JobRequest] = field(default_factory=dict)
    # Pending jobs backing off (not in the queues until then): job -> when they may be placed.
    _held_back: dict[JobId, float] = field(default_factory=dict)
    _recheck: set[JobId] = field(default_factory=set)
    _fleet_version: int = -1
    _policy: Policy | None = None
    _cycles: int = 0

    def bound(self, sched: SchedulerState, limit: int = MAX_TOUCHED) -> None:
        """A replica that does not decide (a standby) still notes every job that changes; past
        `limit` notes they are dropped and the next cycle rebuilds instead (called after each
        batch the feed applies)."""
        if len(sched.touched) > limit:
            sched.touched.clear()
            self.invalidate()

    def invalidate(self) -> None:
        """The kept state can no longer be trusted (a cycle raised inside the core)."""
        self.state = None

    def prepare(self, sched: SchedulerState, policy: Policy, now: float) -> CycleState:
        """The working set as of `now` (wall time: backoffs end by it)."""
        self._cycles += 1
        if (
            self.state is None
            or sched.fleet_version != self._fleet_version
            or policy is not self._policy
        ):
            return self._rebuild(sched, policy, now)
        state = self.state
        changed = sched.touched | self._recheck
        sched.touched.clear()
        self._recheck.clear()
        changed.update(j for j, until in self._held_back.items() if until <= now)
        for job_id in changed:
            self._sync(state, sched, job_id, now)
        if state.levels.active:
            state.attained = sched.attained(now)
        state.preempting = frozenset(sched.preempting)
        state.protected = frozenset(
            j for j, until in sched.protected.items() if until > now and j in sched.running
        )
        state.queues.relevel(state.attained)  # as the cycle would: so the check compares alike
        if self.verify_every and self._cycles % self.verify_every == 0:
            return self._verify(sched, policy, now)
        return state

    def decided(self, placements: tuple[Allocation, ...] | list[Allocation]) -> None:
        for alloc in placements:
            self._queued.pop(alloc.job.job_id, None)
            self._recheck.add(alloc.job.job_id)

    def _rebuild(self, sched: SchedulerState, policy: Policy, now: float) -> CycleState:
        self.rebuilds += 1
        sched.touched.clear()
        self._recheck.clear()
        snapshot = sched.snapshot(now)
        self.state = CycleState.from_snapshot(snapshot, policy, Levels(policy, sched.history))
        self._queued = {job.job_id: job for job in snapshot.pending}
        self._held_back = {
            j: until for j, until in sched.held.items() if until > now and j in sched.pending
        }
        self._fleet_version = sched.fleet_version
        self._policy = policy
        return self.state

    def _sync(self, state: CycleState, sched: SchedulerState, job_id: JobId, now: float) -> None:
        want = sched.running.get(job_id)
        have = state.running.get(job_id)
        if have is not None and have is not want:
            if want is not None and _same_placement(have, want):
                state.swap(want)
            else:
                state.release(job_id)
                have = None
        if want is not None and have is None:
            state.admit(want)
        job = sched.pending.get(job_id)
        until = sched.held.get(job_id, 0.0)
        visible = job is not None and until <= now
        queued = self._queued.get(job_id)
        # Out of the queue: gone, held back, replaced, or re-levelled because the end of an
        # earlier run, read after the requeue, changed what it has attained.
        if queued is not None and (
            not visible
            or queued is not job
            or (
                state.levels.active
                and state.queues.tier(job_id)
                != tier_of(queued, state.levels, sched.served_total(job_id))
            )
        ):
            state.queues.remove(queued)
            del self._queued[job_id]
            queued = None
        if visible and queued is None and job is not None:
            state.queues.add(job, sched.served_total(job_id))
            self._queued[job_id] = job
        if job is not None and not visible:
            self._held_back[job_id] = until
        else:
            self._held_back.pop(job_id, None)

    def _verify(self, sched: SchedulerState, policy: Policy, now: float) -> CycleState:
        """Compares the kept state with one rebuilt from `sched`; keeps deciding on the kept
        one when they agree (so long chains of updates are what gets checked)."""
        kept = self.state
        assert kept is not None
        fresh = CycleState.from_snapshot(sched.snapshot(now), policy, Levels(policy, sched.history))
        problems = differences(kept, fresh)
        if not problems:
            return kept
        self.drifts += 1
        if self.strict:
            raise WorkingSetDrift("; ".join(problems))
        log.error("scheduler working set drifted; rebuilt", differences=problems[:10])
        return self._rebuild(sched, policy, now)


def differences(kept: CycleState, fresh: CycleState) -> list[str]:
    """What differs between a kept working set and one rebuilt from the same events (empty
    when they agree): free capacity per node, each device's use, and where each spread group's
    replicas run."""
    out: list[str] = []
    if set(kept.running) != set(fresh.running):
        out.append(f"running: {sorted(set(kept.running) ^ set(fresh.running))[:5]}")
    kept_pending = {j.job_id for j in kept.queues.jobs()}
    fresh_pending = {j.job_id for j in fresh.queues.jobs()}
    if kept_pending != fresh_pending:
        out.append(f"pending: {sorted(kept_pending ^ fresh_pending)[:5]}")
    # Priority and service level of each pending job (learned levels move with the history).
    tiers = [j for j in kept_pending & fresh_pending if kept.queues.tier(j) != fresh.queues.tier(j)]
    if tiers:
        out.append(f"tiers of pending jobs: {sorted(tiers)[:5]}")
    if kept.cap.index != fresh.cap.index:
        out.append("nodes differ")
        return out
    for name in ("free_total", "free_cpu", "free_memory"):
        a, b = getattr(kept.cap, name), getattr(fresh.cap, name)
        bad = np.flatnonzero(np.abs(a - b) > 1e-6)
        if bad.size:
            node = kept.cap.nodes[int(bad[0])].node_id
            out.append(f"{name} on {bad.size} nodes, e.g. {node}: {a[bad[0]]} != {b[bad[0]]}")
    devices = np.flatnonzero((kept.cap.device_used != fresh.cap.device_used).any(axis=1))
    if devices.size:
        node = kept.cap.nodes[int(devices[0])].node_id
        out.append(f"device use on {devices.size} nodes, e.g. {node}")
    if kept.cap.spread != fresh.cap.spread:
        groups = set(kept.cap.spread) ^ set(fresh.cap.spread) or {
            g for g in kept.cap.spread if kept.cap.spread[g] != fresh.cap.spread.get(g)
        }
        out.append(f"spread groups: {sorted(groups)[:5]}")
    if kept.types_of != fresh.types_of:
        out.append("accelerator types of running jobs")
    if (kept.cap.type_claimed_milli != fresh.cap.type_claimed_milli).any():
        out.append("what type-restricted work holds per accelerator type")
    for key in set(kept.quota.used) | set(fresh.quota.used):
        if abs(kept.quota.used.get(key, 0.0) - fresh.quota.used.get(key, 0.0)) > 1e-6:
            out.append(f"quota used by {key}")
    tenants: set[TenantId] = set(kept.shares.allocated) | set(fresh.shares.allocated)
    for tenant in tenants:
        a = kept.shares.allocated.get(tenant, {})
        b = fresh.shares.allocated.get(tenant, {})
        if any(abs(a.get(k, 0.0) - b.get(k, 0.0)) > 1e-6 for k in set(a) | set(b)):
            out.append(f"fair-share allocation of {tenant}")
    return out


def _same_placement(a: Allocation, b: Allocation) -> bool:
    """Whether two allocations of one job hold the same resources on the same nodes and are
    counted the same way. A swap charges nothing again, so every field of the job the books
    read must be equal: the tenant's quota and fair-share charge (replicas, accelerators, CPU
    and memory per replica), the spread group, and the claim a job restricted to some
    accelerator types holds on its type."""
    ja, jb = a.job, b.job
    return (
        ja.job_id == jb.job_id
        and a.replicas == b.replicas
        and (ja.tenant, ja.replicas, ja.spread_group, ja.accelerator_types)
        == (jb.tenant, jb.replicas, jb.spread_group, jb.accelerator_types)
        and abs(ja.accelerators - jb.accelerators) <= EPS
        and abs(ja.cpu - jb.cpu) <= EPS
        and abs(ja.memory_gb - jb.memory_gb) <= EPS
    )
