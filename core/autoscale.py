"""How many nodes each elastic pool should have (pure): the autoscaler's decision, used by the
simulator and by the autoscaler service alike.

Scale up only for demand that waits for capacity and would fit a new node: each waiting job,
in the order given (the queue's), goes to the cheapest pool that can hold its whole gang
(effective price = price per accelerator-hour / relative speed), spot pools only for
preemptible work, within the pool's maximum and the spend allowed. Capacity already on its way
(nodes provisioning) and empty ready nodes are matched first, so the same demand never buys
twice. Scale down ready nodes that have been empty for the pool's cool-down and that no
waiting job was matched to, never below the pool's minimum and never a node running work.

Nothing here reads a clock or does I/O; `now` is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from core.capacity import MILLI, milli
from core.model import (
    AcceleratorModel,
    ClusterId,
    JobRequest,
    Node,
    NodeId,
    PriceTier,
    TopologyLevel,
)

EPS = 1e-9


@dataclass(frozen=True)
class NodePool:
    """An elastic group of identical nodes in one cluster (one topology block)."""

    name: str
    cluster: ClusterId
    accelerator: AcceleratorModel
    accelerators_per_node: int
    cpu: float
    memory_gb: float
    price_tier: PriceTier
    # Per accelerator-hour.
    price: float
    min_nodes: int = 0
    max_nodes: int = 0
    # Seconds from the request until a node can take work.
    provision_s: float = 180.0
    # A ready node empty this long is removed (if the pool is above its minimum).
    cooldown_s: float = 600.0
    # The simulated fleet only: the chance that a node asked for never comes (a stockout).
    stockout_rate: float = 0.0

    @property
    def effective_price(self) -> float:
        """Price of the work done: an accelerator twice as fast costs half per unit of work."""
        return self.price / max(self.accelerator.relative_speed, EPS)

    @property
    def node_price_per_hour(self) -> float:
        return self.price * self.accelerators_per_node

    def node(self, node_id: str, seq: int) -> Node:
        """Its node number `seq`: all in one topology block, racks of 8, each node its own
        NVLink domain."""
        return Node(
            node_id=NodeId(node_id),
            cluster=self.cluster,
            block=f"{self.name}-b0",
            rack=f"{self.name}-r{seq // 8}",
            nvlink_domain=f"{self.name}-nv{seq}",
            accelerator=self.accelerator,
            accelerators=self.accelerators_per_node,
            cpu=self.cpu,
            memory_gb=self.memory_gb,
            price_tier=self.price_tier,
        )


@dataclass(frozen=True)
class PoolNode:
    """One node of a pool as the autoscaler sees it."""

    node_id: str
    requested_at: float
    # None while provisioning.
    ready_at: float | None = None
    # Accelerators in use now (0: empty).
    used: float = 0.0
    # Since when it has been empty (ready nodes only).
    empty_since: float | None = None


@dataclass(frozen=True)
class Demand:
    """A job waiting for capacity (not for quota, fair share or priority)."""

    job: JobRequest
    # Its tenant's budget is spent (or in `block` mode): it creates no demand.
    budget_blocked: bool = False


@dataclass(frozen=True)
class PoolDecision:
    pool: str
    add: int = 0
    remove: tuple[str, ...] = ()
    # Jobs the added nodes are for, and why nodes go.
    for_jobs: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True)
class Unserved:
    job_id: str
    tenant: str
    # no_pool_fits | pool_max | cloud_budget | tenant_budget | spot_not_allowed
    reason: str
    message: str


@dataclass
class Plan:
    decisions: list[PoolDecision] = field(default_factory=list)
    unserved: list[Unserved] = field(default_factory=list)
    # Job id -> pool it was matched to (on capacity already there, coming, or added now).
    matched: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SpendLimit:
    """The most the elastic pools may cost per hour together right now (e.g. the budget left
    for the period divided by the hours left in it), and what they cost now."""

    max_per_hour: float
    current_per_hour: float


@dataclass
class _Slot:
    """A node the demand can be matched to: existing (empty or coming) or planned now."""

    free: float
    cpu: float
    memory_gb: float
    node_id: str | None  # None: planned by this decision


@dataclass
class _PoolWork:
    pool: NodePool
    slots: list[_Slot]
    size: int  # nodes the pool has or has asked for
    added: int = 0
    for_jobs: list[str] = field(default_factory=list)
    kept: set[str] = field(default_factory=set)


def decide(
    pools: Sequence[NodePool],
    nodes: Mapping[str, Sequence[PoolNode]],
    demand: Iterable[Demand],
    now: float,
    *,
    spend: SpendLimit | None = None,
    spot_for_preemptible_only: bool = True,
) -> Plan:
    """What each pool should do now. `nodes`: each pool's nodes (ready or provisioning)."""
    plan = Plan()
    work = {p.name: _start(p, nodes.get(p.name, ())) for p in pools}
    order = sorted(pools, key=lambda p: (p.effective_price, p.name))
    allowance = math.inf if spend is None else spend.max_per_hour - spend.current_per_hour
    closed: tuple[str, str] | None = None
    for d in demand:
        job = d.job
        if closed is None:
            closed = _all_closed(order, work, allowance)
        if closed is not None and not d.budget_blocked:
            # Nothing left to match or buy: the rest of the demand is answered at once.
            plan.unserved.append(Unserved(job.job_id, job.tenant, *closed))
            continue
        if d.budget_blocked:
            plan.unserved.append(
                Unserved(job.job_id, job.tenant, "tenant_budget", "its tenant's budget is spent")
            )
            continue
        served, why = _serve(job, order, work, spot_for_preemptible_only, allowance)
        if served is None:
            plan.unserved.append(Unserved(job.job_id, job.tenant, why[0], why[1]))
            continue
        plan.matched[job.job_id] = served.pool.name
        allowance -= served.last_cost
    for w in work.values():
        below = w.pool.min_nodes - w.size - w.added
        if below > 0:
            w.added += below
        remove = _idle(w, nodes.get(w.pool.name, ()), now)
        if w.added or remove:
            reasons = []
            if w.for_jobs:
                reasons.append(f"{len(w.for_jobs)} waiting job(s) need new node(s)")
            if below > 0:
                reasons.append(f"below its minimum of {w.pool.min_nodes} nodes")
            if remove:
                reasons.append(f"{len(remove)} node(s) empty for {w.pool.cooldown_s:.0f} s or more")
            plan.decisions.append(
                PoolDecision(
                    w.pool.name, w.added, tuple(remove), tuple(w.for_jobs), "; ".join(reasons)
                )
            )
    return plan


def _all_closed(
    order: Sequence[NodePool], work: Mapping[str, _PoolWork], allowance: float
) -> tuple[str, str] | None:
    """Why no pool can take any more work (no free slot, and no node may be added), or None."""
    reasons = []
    for pool in order:
        w = work[pool.name]
        if any(s.free > EPS for s in w.slots):
            return None
        if w.size + w.added < pool.max_nodes:
            if pool.node_price_per_hour <= allowance + EPS:
                return None
            reasons.append(("cloud_budget", "the spend budget allows no more nodes"))
        else:
            reasons.append(("pool_max", "every elastic pool is at its maximum"))
    return reasons[0] if reasons else ("no_pool_fits", "there is no elastic pool")


def _start(pool: NodePool, nodes: Sequence[PoolNode]) -> _PoolWork:
    """Empty ready nodes and provisioning ones are the first places demand goes."""
    slots = [
        _Slot(pool.accelerators_per_node, pool.cpu, pool.memory_gb, n.node_id)
        for n in sorted(nodes, key=lambda n: n.node_id)
        if n.ready_at is None or n.used <= EPS
    ]
    return _PoolWork(pool, slots, size=len(nodes))


@dataclass
class _Served:
    pool: NodePool
    last_cost: float


def _serve(
    job: JobRequest,
    order: Sequence[NodePool],
    work: Mapping[str, _PoolWork],
    spot_rule: bool,
    allowance: float,
) -> tuple[_Served | None, tuple[str, str]]:
    why = ("no_pool_fits", "no elastic pool has nodes this job fits")
    for pool in order:
        if job.accelerator_types and pool.accelerator.type not in job.accelerator_types:
            continue
        if job.accelerator_memory_gb and pool.accelerator.memory_gb < job.accelerator_memory_gb:
            continue
        if spot_rule and pool.price_tier is PriceTier.SPOT and not job.preemptible:
            why = ("spot_not_allowed", "only spot pools fit and the job is not preemptible")
            continue
        if not _fits_a_node(job, pool):
            continue
        w = work[pool.name]
        trial = [_Slot(s.free, s.cpu, s.memory_gb, s.node_id) for s in w.slots]
        packed = _pack(job, pool, trial, w.pool.max_nodes - w.size - w.added)
        if packed is None:
            why = ("pool_max", f"pool {pool.name} is at its maximum of {pool.max_nodes} nodes")
            continue
        new, used = packed
        cost = new * pool.node_price_per_hour
        if cost > allowance + EPS:
            why = (
                "cloud_budget",
                f"{new} more node(s) of {pool.name} would cost {cost:.2f}/h; the spend "
                f"budget allows {max(allowance, 0.0):.2f}/h more",
            )
            continue
        w.slots = trial
        w.added += new
        if new:
            w.for_jobs.append(job.job_id)
        w.kept |= used
        return _Served(pool, cost), why
    return None, why


def _fits_a_node(job: JobRequest, pool: NodePool) -> bool:
    per_node = _per_node(job, pool)
    if per_node == 0 or job.accelerators <= 0:
        return False  # accelerator pools are not bought for work without accelerators
    return per_node >= job.replicas if _one_node(job) else True


def _per_node(job: JobRequest, pool: NodePool) -> int:
    """How many replicas of the job one empty node of the pool holds."""
    limits = [
        pool.cpu / job.cpu if job.cpu > 0 else math.inf,
        pool.memory_gb / job.memory_gb if job.memory_gb > 0 else math.inf,
    ]
    if job.accelerators >= 1:
        limits.append(pool.accelerators_per_node / job.accelerators)
    elif job.accelerators > 0:
        # Fractions share a device but never span two.
        limits.append(pool.accelerators_per_node * (MILLI // milli(job.accelerators)))
    fit = min(limits)
    return int(min(fit + EPS, 10**6)) if fit != math.inf else 10**6


def _pack(
    job: JobRequest, pool: NodePool, slots: list[_Slot], room: int
) -> tuple[int, set[str]] | None:
    """Put every replica on a slot (first fit, existing slots first), opening new nodes as
    needed up to `room`: how many were opened and which existing nodes were used, or None if
    the gang does not fit."""
    opened, used = 0, set()
    together = job.replicas if _one_node(job) else 1
    for _ in range(job.replicas // together):
        target = next((s for s in slots if _room(s, job, together)), None)
        if target is None:
            if opened >= room:
                return None
            target = _Slot(pool.accelerators_per_node, pool.cpu, pool.memory_gb, None)
            slots.append(target)
            opened += 1
        elif target.node_id is not None:
            used.add(target.node_id)
        _use(target, job, together)
    return opened, used


def _one_node(job: JobRequest) -> bool:
    return job.topology_required and job.topology in (TopologyLevel.NODE, TopologyLevel.NVLINK)


def _room(s: _Slot, job: JobRequest, replicas: int) -> bool:
    return (
        s.free + EPS >= job.accelerators * replicas
        and s.cpu + EPS >= job.cpu * replicas
        and s.memory_gb + EPS >= job.memory_gb * replicas
    )


def _use(s: _Slot, job: JobRequest, replicas: int) -> None:
    s.free -= job.accelerators * replicas
    s.cpu -= job.cpu * replicas
    s.memory_gb -= job.memory_gb * replicas


def _idle(w: _PoolWork, nodes: Sequence[PoolNode], now: float) -> list[str]:
    """Ready nodes empty for the cool-down that no waiting job was matched to, most idle
    first, down to the pool's minimum."""
    pool = w.pool
    removable = sorted(
        (
            n
            for n in nodes
            if n.ready_at is not None
            and n.used <= EPS
            and n.empty_since is not None
            and now - n.empty_since >= pool.cooldown_s
            and n.node_id not in w.kept
        ),
        key=lambda n: (n.empty_since or 0.0, n.node_id),
    )
    spare = len(nodes) + w.added - pool.min_nodes
    return [n.node_id for n in removable[: max(spare, 0)]]
