"""The simulator with elastic node pools: the autoscaler's decision (`core.autoscale.decide`,
the same code the autoscaler service runs) after every scheduling cycle, nodes joining after
their pool's provisioning delay and leaving when the decision removes them.

Three ways to run a pool, for comparison in one run (bench/autoscale.py):
- `none`: the pool never has a node;
- `always`: the pool's maximum from the start, never removed;
- `autoscale`: what `decide` says, from the pool's minimum.

A node is billed from its request until it is removed (instances are paid while they boot).
The demand the autoscaler sees is every job still pending after the cycle's passes: in the
simulator every wait is a wait for capacity (the bench runs without quotas). A spend budget
per period (e.g. a month) turns into the hourly rate the pools may cost right now: what is left
of it divided by the hours left in the period, so spend never passes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from core.autoscale import Demand, NodePool, PoolNode, SpendLimit, decide
from core.capacity import EPS
from core.cycle import CycleState
from core.model import Allocation, Cluster, ClusterId, JobId, Node, NodeId, Snapshot
from core.policy import Policy
from sim.engine import EventKind, JobRecord, Simulation
from sim.workload import SimJob

READY = 1  # NODE event codes: a node is ready; a scale-down check is due
CHECK = 0


class PoolMode(StrEnum):
    NONE = "none"
    ALWAYS = "always"
    AUTOSCALE = "autoscale"


@dataclass(frozen=True)
class SpendBudget:
    """At most `amount` on the elastic pools per `period_s` (from the start of the replay)."""

    amount: float
    period_s: float = 30 * 86400.0


@dataclass
class _Member:
    node: Node
    requested_at: float
    ready_at: float | None = None
    removed_at: float | None = None
    empty_since: float | None = None


@dataclass
class PoolBill:
    """What one pool cost and did over a replay."""

    nodes_bought: int = 0
    # Accelerator-seconds paid (request to removal) and used (work on its nodes).
    bought_s: float = 0.0
    used_s: float = 0.0
    cost: float = 0.0
    peak_nodes: int = 0
    scale_ups: int = 0
    scale_downs: int = 0


class ElasticSimulation(Simulation):
    def __init__(
        self,
        clusters: Mapping[ClusterId, Cluster],
        nodes: Mapping[NodeId, Node],
        policy: Policy,
        jobs: list[SimJob],
        pools: Sequence[NodePool],
        mode: PoolMode = PoolMode.AUTOSCALE,
        budget: SpendBudget | None = None,
        cycle_interval_s: float = 60.0,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self.pools = list(pools)
        self.mode = mode
        self.budget = budget
        self.clusters = dict(clusters)
        self.fixed = dict(nodes)
        self.members: dict[str, dict[NodeId, _Member]] = {p.name: {} for p in self.pools}
        self.pool_of: dict[NodeId, NodePool] = {}
        self.bills = {p.name: PoolBill() for p in self.pools}
        # Tenant -> jobs the spend budget kept the autoscaler from buying for.
        self.unserved_for_budget: dict[str, set[str]] = {}
        self._node_seq = 0
        self._check_at: float | None = None
        self._pool_busy = {p.name: 0.0 for p in self.pools}
        self._pool_used = {p.name: 0.0 for p in self.pools}
        start = dict(nodes)
        if mode is PoolMode.ALWAYS:
            for pool in self.pools:
                for _ in range(pool.max_nodes):
                    member = self._new_member(pool, 0.0)
                    member.ready_at, member.empty_since = 0.0, 0.0
                    start[member.node.node_id] = member.node
        super().__init__(clusters, start, policy, jobs, cycle_interval_s, progress)
        for pool in self.pools:
            self.bills[pool.name].peak_nodes = len(self.members[pool.name])
        for pool in self.pools:
            for member in self.members[pool.name].values():
                self._devices[member.node.node_id] = float(pool.accelerators_per_node)
        if mode is PoolMode.AUTOSCALE and any(p.min_nodes for p in self.pools):
            self._autoscale()

    # --- the replay ------------------------------------------------------------------------

    def run(self) -> dict[JobId, JobRecord]:
        records = super().run()
        for name, members in self.members.items():
            for member in members.values():
                if member.removed_at is None:
                    self._bill(self._pool(name), member, self._now)
            self.bills[name].used_s = self._pool_used[name]
        return records

    def _advance(self, at: float) -> None:
        dt = at - self._now
        if dt > 0:
            for name, busy in self._pool_busy.items():
                self._pool_used[name] += busy * dt
        super()._advance(at)

    def _cycle(self) -> None:
        super()._cycle()
        if self.mode is PoolMode.AUTOSCALE:
            self._autoscale()

    def _on_node_event(self, subject: str, code: int) -> None:
        if code == READY:
            node_id = NodeId(subject)
            pool = self.pool_of[node_id]
            member = self.members[pool.name][node_id]
            if member.removed_at is not None:
                return
            member.ready_at = member.empty_since = self._now
            self._rebuild()
            self._want_cycle()
        else:
            self._check_at = None
            if self.mode is PoolMode.AUTOSCALE:
                self._autoscale()

    def _ledger(self, alloc: Allocation, sign: float) -> None:
        super()._ledger(alloc, sign)
        for r in alloc.replicas:
            pool = self.pool_of.get(r.node_id)
            if pool is None:
                continue
            self._pool_busy[pool.name] += sign * r.accelerators
            member = self.members[pool.name][r.node_id]
            if self._on_node.get(r.node_id, 0.0) > EPS:
                member.empty_since = None
            elif member.empty_since is None:
                member.empty_since = self._now

    # --- the autoscaler ----------------------------------------------------------------------

    def _autoscale(self) -> None:
        now = self._now
        demand = [Demand(job) for job in self.state.queues.jobs()]
        views = {
            name: [
                PoolNode(
                    str(m.node.node_id),
                    m.requested_at,
                    m.ready_at,
                    self._on_node.get(m.node.node_id, 0.0),
                    m.empty_since,
                )
                for m in members.values()
                if m.removed_at is None
            ]
            for name, members in self.members.items()
        }
        plan = decide(
            self.pools,
            views,
            demand,
            now,
            spend=self._spend_limit(),
            spot_for_preemptible_only=self.policy.placement.spot_for_preemptible_only,
        )
        for u in plan.unserved:
            if u.reason == "cloud_budget":
                self.unserved_for_budget.setdefault(u.tenant, set()).add(u.job_id)
        changed = False
        for d in plan.decisions:
            pool = self._pool(d.pool)
            bill = self.bills[pool.name]
            if d.add:
                bill.scale_ups += 1
            for _ in range(d.add):
                member = self._new_member(pool, now)
                at = now + pool.provision_s
                self._push(at, EventKind.NODE, JobId(member.node.node_id), READY)
            for node_id in d.remove:
                member = self.members[pool.name][NodeId(node_id)]
                self._bill(pool, member, now)
                bill.scale_downs += 1
                changed = True
            live = sum(1 for m in self.members[pool.name].values() if m.removed_at is None)
            bill.peak_nodes = max(bill.peak_nodes, live)
        if changed:
            self._rebuild()
        self._plan_check()

    def _spend_limit(self) -> SpendLimit | None:
        rate = sum(
            self._pool(name).node_price_per_hour
            for name, members in self.members.items()
            for m in members.values()
            if m.removed_at is None
        )
        if self.budget is None:
            return SpendLimit(math.inf, rate)
        period = self.budget.period_s
        start = math.floor(self._now / period) * period
        spent = sum(self._spent(name, start) for name in self.members)
        hours_left = max((start + period - self._now) / 3600.0, 1 / 60)
        return SpendLimit(max(self.budget.amount - spent, 0.0) / hours_left, rate)

    def _spent(self, name: str, since: float, until: float | None = None) -> float:
        pool = self._pool(name)
        total = 0.0
        for m in self.members[name].values():
            begin = max(m.requested_at, since)
            end = m.removed_at if m.removed_at is not None else self._now
            if until is not None:
                end = min(end, until)
            if end > begin:
                total += (end - begin) / 3600.0 * pool.node_price_per_hour
        return total

    def spend_by_period(self, period_s: float) -> list[float]:
        """What the pools cost in each period of the replay (after `run`)."""
        periods = max(math.ceil(self._now / period_s), 1)
        return [
            sum(self._spent(name, k * period_s, (k + 1) * period_s) for name in self.members)
            for k in range(periods)
        ]

    def _plan_check(self) -> None:
        """A scale-down check when the next empty node's cool-down runs out."""
        due = [
            m.empty_since + self._pool(name).cooldown_s
            for name, members in self.members.items()
            for m in members.values()
            if m.removed_at is None and m.ready_at is not None and m.empty_since is not None
        ]
        # A node already past its cool-down but kept (demand was matched to it, or the pool
        # is at its minimum) is looked at again with the next cycle, not in a loop now.
        due = [t for t in due if t > self._now]
        if not due:
            return
        at = min(due)
        if self._check_at is None or at < self._check_at:
            self._check_at = at
            self._push(at, EventKind.NODE, JobId(""), CHECK)

    # --- nodes ------------------------------------------------------------------------------

    def _new_member(self, pool: NodePool, now: float) -> _Member:
        self._node_seq += 1
        seq = self._node_seq
        node_id = NodeId(f"{pool.name}-{seq:05d}")
        node = pool.node(node_id, seq)
        member = _Member(node, requested_at=now)
        self.members[pool.name][node_id] = member
        self.pool_of[node_id] = pool
        self.bills[pool.name].nodes_bought += 1
        return member

    def _bill(self, pool: NodePool, member: _Member, at: float) -> None:
        member.removed_at = at
        seconds = at - member.requested_at
        bill = self.bills[pool.name]
        bill.bought_s += seconds * pool.accelerators_per_node
        bill.cost += seconds / 3600.0 * pool.node_price_per_hour

    def _pool(self, name: str) -> NodePool:
        return next(p for p in self.pools if p.name == name)

    def _rebuild(self) -> None:
        """The fleet changed: a fresh working set over the ready nodes, with what runs and
        waits carried over (reservations are recomputed by the next cycle)."""
        nodes = dict(self.fixed)
        for members in self.members.values():
            for m in members.values():
                if m.ready_at is not None and m.removed_at is None:
                    nodes[m.node.node_id] = m.node
                    self._devices[m.node.node_id] = float(m.node.accelerators)
        pending = list(self.state.queues.jobs())
        attained = {j.job_id: self.records[j.job_id].attained for j in pending}
        snapshot = Snapshot(
            clusters=self.clusters,
            nodes=nodes,
            running=dict(self.state.running),
            pending=pending,
            usage=dict(self._usage),
            attained=attained,
        )
        self.state = CycleState.from_snapshot(snapshot, self.policy, self.state.levels)
