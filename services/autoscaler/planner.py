"""What the autoscaler knows from the log, and the decisions it takes from it (no I/O): the
leading scheduler's demand (`capacity.demand`), each cluster's pools as its executor holds
them (`cluster.capacity`), and the tenants whose budget is spent (`budget.exceeded`). The
decision itself is `core.autoscale.decide`, the code the simulator runs.

Restart safety: a decision is a pool's size, not a delta, and nothing is decided for a cluster
until an inventory sent after this process started has been read, so a decision made just
before a restart is seen in the pool's nodes (provisioning) rather than made again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from core.autoscale import Demand, NodePool, SpendLimit, decide
from core.autoscale import PoolNode as CorePoolNode
from core.model import JobId, JobRequest, TenantId, TopologyLevel, WorkloadKind
from schemas.events import (
    AutoscaleDecided,
    CapacityDemand,
    ClusterCapacity,
    DemandItem,
    PoolNodeState,
    PoolStatus,
)
from schemas.usage import BudgetExceeded, Enforcement


@dataclass(frozen=True)
class Incident:
    pool: str
    cluster: str
    cause: str
    since: datetime


@dataclass
class Observed:
    ready_after_s: list[float] = field(default_factory=list)
    idle_node_s: float = 0.0


@dataclass
class Plan:
    decisions: list[AutoscaleDecided] = field(default_factory=list)
    # Pools that just started failing (stockout, quota): one alert each; and pools whose
    # incident ended (a node came).
    incidents: list[Incident] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    # Job id -> why no pool was grown for it (for `qm pools` and the log).
    unserved: dict[str, str] = field(default_factory=dict)


@dataclass
class MonthlySpend:
    """What the elastic pools have cost this calendar month against a fleet-wide cloud budget:
    the pools' price per hour (ready and provisioning nodes, as the inventories show them)
    integrated over time, in fleet time (wall time x the time scale). A control figure for
    deciding, not the bill (the meter's records are). While the autoscaler is away its last
    rate goes on counting: the pools do not change size without it."""

    budget: float
    month: str = ""
    spent: float = 0.0
    rate: float = 0.0  # per fleet hour, since `at`
    at: datetime | None = None

    def advance(self, now: datetime, rate: float, time_scale: float) -> None:
        month = now.strftime("%Y-%m")
        if self.at is not None:
            start = max(self.at, _month_start(now)) if month != self.month else self.at
            if month != self.month:
                self.spent = 0.0
            hours = max((now - start).total_seconds(), 0.0) / 3600 * time_scale
            self.spent += self.rate * hours
        self.month, self.rate, self.at = month, rate, now

    def limit(self, now: datetime, time_scale: float) -> SpendLimit:
        """What the pools may cost per fleet hour: the budget left over the hours left in the
        month, so spend never passes it."""
        end = _next_month_start(now)
        hours_left = max((end - now).total_seconds() / 3600 * time_scale, 1 / 60)
        return SpendLimit(max(self.budget - self.spent, 0.0) / hours_left, self.rate)


def _month_start(at: datetime) -> datetime:
    return datetime(at.year, at.month, 1, tzinfo=UTC)


def _next_month_start(at: datetime) -> datetime:
    year, month = (at.year + 1, 1) if at.month == 12 else (at.year, at.month + 1)
    return datetime(year, month, 1, tzinfo=UTC)


class Planner:
    def __init__(
        self,
        pools: Sequence[NodePool],
        time_scale: float,
        started_at: datetime,
        spot_for_preemptible_only: bool = True,
        resend_after_s: float = 15.0,
        demand_stale_s: float = 120.0,
        failing_pause_s: float = 300.0,
        cloud_budget_per_month: float | None = None,
    ) -> None:
        self.pools = {p.name: p for p in pools}
        self.spend = (
            MonthlySpend(cloud_budget_per_month) if cloud_budget_per_month is not None else None
        )
        self.time_scale = time_scale
        self.started_at = started_at
        self.spot_rule = spot_for_preemptible_only
        self.resend_after_s = resend_after_s
        self.demand_stale_s = demand_stale_s
        self.failing_pause_s = failing_pause_s
        self.demand: CapacityDemand | None = None
        self.demand_at: datetime | None = None
        self.capacity: dict[str, ClusterCapacity] = {}
        self.capacity_at: dict[str, datetime] = {}
        self.fresh: set[str] = set()  # clusters with an inventory from after our start
        # (tenant, month) whose budget is spent or blocks.
        self.blocked: set[tuple[str, str]] = set()
        # Pool -> (desired, remove, when) of the last decision sent.
        self.sent: dict[str, tuple[int, tuple[str, ...], datetime]] = {}
        self.failing: dict[str, Incident] = {}

    # --- reading the log --------------------------------------------------------------------

    def on_demand(self, d: CapacityDemand, at: datetime) -> None:
        if self.demand is not None and d.epoch < self.demand.epoch:
            return  # a deposed leader's view
        self.demand, self.demand_at = d, at

    def on_capacity(self, c: ClusterCapacity, at: datetime) -> Observed:
        """Take in an inventory; what it shows since the previous one: nodes that became
        ready (with how long they took) and the node-seconds pool nodes sat empty."""
        before = self.capacity.get(c.cluster)
        before_at = self.capacity_at.get(c.cluster)
        self.capacity[c.cluster] = c
        self.capacity_at[c.cluster] = at
        if at >= self.started_at:
            self.fresh.add(c.cluster)
        seen = Observed()
        if before is None or before_at is None or at <= before_at:
            return seen
        was = {n.node_id: n for s in before.pools for n in s.nodes}
        span = (at - before_at).total_seconds()
        for s in c.pools:
            for n in s.nodes:
                old = was.get(n.node_id)
                if n.state is PoolNodeState.READY and n.ready_at is not None:
                    if old is not None and old.state is PoolNodeState.PROVISIONING:
                        seen.ready_after_s.append((n.ready_at - n.requested_at).total_seconds())
                    idle_before = old is not None and old.state is PoolNodeState.READY
                    if n.used <= 0 and idle_before and old is not None and old.used <= 0:
                        seen.idle_node_s += span
        return seen

    def on_budget(self, b: BudgetExceeded) -> bool:
        """A tenant-wide budget spent (blocking or deprioritizing): True if it blocks now."""
        spent = b.threshold_pct >= 100 and b.project is None
        if spent and b.enforcement in (Enforcement.BLOCK, Enforcement.DEPRIORITIZE):
            self.blocked.add((b.tenant, b.month))
            return True
        return False

    # --- deciding ---------------------------------------------------------------------------

    def plan(self, now: datetime) -> Plan:
        plan = Plan()
        status = {
            s.pool: (cluster, s)
            for cluster, cap in self.capacity.items()
            for s in cap.pools
            if s.pool in self.pools
        }
        self._incidents(status, now, plan)
        # A paused pool (its last request failed lately) buys nothing (its maximum is what it
        # has) but still lets its empty nodes go.
        ready = [
            replace(p, max_nodes=len(status[name][1].nodes))
            if self._paused(status[name][1], now)
            else p
            for name, p in self.pools.items()
            if name in status and status[name][0] in self.fresh
        ]
        if not ready:
            return plan
        spend = None
        if self.spend is not None:
            self.spend.advance(now, self.spend_rate(), self.time_scale)
            spend = self.spend.limit(now, self.time_scale)
        fleet_now = now.timestamp() * self.time_scale
        nodes = {p.name: self._nodes(status[p.name][1]) for p in ready}
        month = now.strftime("%Y-%m")
        demand = [
            Demand(_request(item), budget_blocked=(item.tenant, month) in self.blocked)
            for item in self._demand(now)
        ]
        result = decide(
            ready,
            nodes,
            demand,
            fleet_now,
            spot_for_preemptible_only=self.spot_rule,
            spend=spend,
        )
        plan.unserved = {u.job_id: u.message for u in result.unserved}
        for d in result.decisions:
            cluster, current = status[d.pool]
            live = [n for n in current.nodes if n.node_id not in d.remove]
            desired = len(live) + d.add
            remove = tuple(sorted(d.remove))
            if self._already_sent(d.pool, desired, remove, current, now):
                continue
            plan.decisions.append(
                AutoscaleDecided(
                    cluster=cluster,
                    pool=d.pool,
                    desired_nodes=desired,
                    remove=list(remove),
                    for_jobs=list(d.for_jobs),
                    reason=d.reason,
                    inventory_at=self.capacity_at.get(cluster),
                )
            )
            self.sent[d.pool] = (desired, remove, now)
        return plan

    def spend_rate(self) -> float:
        """What the pools' nodes (ready and provisioning) cost per hour now."""
        total = 0.0
        for cap in self.capacity.values():
            for s in cap.pools:
                pool = self.pools.get(s.pool)
                if pool is not None:
                    total += len(s.nodes) * pool.node_price_per_hour
        return total

    def _demand(self, now: datetime) -> list[DemandItem]:
        if self.demand is None or self.demand_at is None:
            return []
        if (now - self.demand_at).total_seconds() > self.demand_stale_s:
            return []  # the scheduler has said nothing for long: decide nothing on old news
        return list(self.demand.jobs)

    def _nodes(self, s: PoolStatus) -> list[CorePoolNode]:
        scale = self.time_scale
        return [
            CorePoolNode(
                n.node_id,
                requested_at=n.requested_at.timestamp() * scale,
                ready_at=n.ready_at.timestamp() * scale if n.ready_at else None,
                used=n.used if n.state is PoolNodeState.READY else 0.0,
                empty_since=n.empty_since.timestamp() * scale if n.empty_since else None,
            )
            for n in s.nodes
        ]

    def _already_sent(
        self,
        pool: str,
        desired: int,
        remove: tuple[str, ...],
        current: PoolStatus,
        now: datetime,
    ) -> bool:
        """The same decision went out lately and the executor has not shown it yet."""
        last = self.sent.get(pool)
        if last is None or (last[0], last[1]) != (desired, remove):
            return False
        return (now - last[2]).total_seconds() < self.resend_after_s

    def _paused(self, s: PoolStatus, now: datetime) -> bool:
        """A pool whose last request failed lately gets no demand (it goes to the next
        cheapest pool) for `failing_pause_s`; then it is tried again."""
        if s.failed_at is None or s.failing is None:
            return False
        return (now - s.failed_at).total_seconds() < self.failing_pause_s

    def _incidents(
        self, status: Mapping[str, tuple[str, PoolStatus]], now: datetime, plan: Plan
    ) -> None:
        """One incident (one alert) from a pool's first failed request until a node of it
        comes again. Open incidents are stored (app.py) and given back at start, so a restart
        neither alerts one again nor loses one."""
        for name, (cluster, s) in status.items():
            if s.failing and name not in self.failing:
                incident = Incident(name, cluster, s.failing, now)
                self.failing[name] = incident
                plan.incidents.append(incident)
            elif not s.failing and name in self.failing:
                del self.failing[name]
                plan.closed.append(name)


def _request(item: DemandItem) -> JobRequest:
    try:
        topology = TopologyLevel(item.topology)
    except ValueError:
        topology = TopologyLevel.CLUSTER
    return JobRequest(
        job_id=JobId(item.job_id),
        tenant=TenantId(item.tenant),
        project="",
        user="",
        queue="",
        priority_class="",
        kind=WorkloadKind.TRAINING,
        replicas=item.replicas,
        accelerators=item.accelerators,
        accelerator_types=tuple(item.accelerator_types),
        accelerator_memory_gb=item.accelerator_memory_gb,
        cpu=item.cpu,
        memory_gb=item.memory_gb,
        topology=topology,
        topology_required=item.topology_required,
        preemptible=item.preemptible,
        submit_time=0.0,
    )
