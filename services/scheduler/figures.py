"""The leader's figures for /metrics, read off the working set a cycle has just decided on and
the state it came from: jobs by state, pending jobs by reason, each tenant's quota, use,
borrowing and share, accelerators by state, and how fragmented the free ones are. Pure: the
cycle hands them to SchedulerMetrics (handlers.py) at most once a second.

Every label is a closed or configured set (tenant, cluster, accelerator type, reason code,
job state, gang size): never a job, user or node id."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from core.capacity import MILLI, Capacity
from core.model import JobId, TenantId
from core.policy import Policy
from core.reasons import PendingExplanation
from core.state import CycleState
from services.scheduler.state import SchedulerState

# Sizes (whole devices on one node) of the replicas counted in `free_slots`: the usual gang
# member shapes, up to a whole 8-device node.
SLOT_SIZES = (1, 2, 4, 8)
NO_REASON = "unexplained"  # a pending job the last cycle gave no code (not looked at yet)


@dataclass(frozen=True)
class TenantFigures:
    # (tenant, accelerator type) -> accelerators
    quota: dict[tuple[str, str], float] = field(default_factory=dict)
    allocated: dict[tuple[str, str], float] = field(default_factory=dict)
    borrowed: dict[tuple[str, str], float] = field(default_factory=dict)
    # tenant -> share of the fleet
    dominant_share: dict[str, float] = field(default_factory=dict)
    fair_share: dict[str, float] = field(default_factory=dict)
    ordering_share: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetFigures:
    # (cluster, accelerator type, state) -> accelerators
    accelerators: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # (cluster, accelerator type, size) -> replicas of `size` whole devices that fit now
    free_slots: dict[tuple[str, str, str], int] = field(default_factory=dict)
    # (cluster, accelerator type) -> share of free devices not on a wholly free node
    fragmentation: dict[tuple[str, str], float] = field(default_factory=dict)


def jobs_by_state(state: SchedulerState, now: float) -> Counter[tuple[str, str]]:
    """(state, tenant) -> jobs: pending (may be placed now), backing_off (requeued or refused,
    waiting out a backoff), running, preempting (asked to yield, not gone yet). Counted by
    tenant in one pass over each dict (Counter counts in C), the few held back apart."""
    pending, running = state.pending, state.running
    waiting = Counter(pending[j].tenant for j, t in state.held.items() if t > now and j in pending)
    leaving = Counter(running[j].job.tenant for j in state.preempting if j in running)
    all_pending = Counter(job.tenant for job in pending.values())
    all_running = Counter(alloc.job.tenant for alloc in running.values())
    out: Counter[tuple[str, str]] = Counter()
    for name, total, apart, apart_name in (
        ("pending", all_pending, waiting, "backing_off"),
        ("running", all_running, leaving, "preempting"),
    ):
        for tenant, n in total.items():
            if n - apart[tenant]:
                out[(name, str(tenant))] = n - apart[tenant]
        for tenant, n in apart.items():
            out[(apart_name, str(tenant))] = n
    return out


def pending_by_reason(
    state: SchedulerState, explained: Mapping[JobId, PendingExplanation]
) -> Counter[tuple[str, str]]:
    """(tenant, reason) -> pending jobs, each under the first code of its explanation (the
    first thing that stopped it), so the figures add up to the pending jobs."""
    get = explained.get
    counted = Counter(
        (job.tenant, _first_code(get(job_id))) for job_id, job in state.pending.items()
    )
    return Counter({(str(t), str(code)): n for (t, code), n in counted.items()})


def _first_code(why: PendingExplanation | None) -> str:
    return why.codes[0] if why is not None and why.codes else NO_REASON


def tenant_figures(working: CycleState, policy: Policy) -> TenantFigures:
    """Quota, use and borrowing per tenant and accelerator type (from the quota book), and
    three shares per tenant: its dominant share of the fleet now, its fair share (its weight
    over the weights of the tenants that run or wait), and the figure tenants are ordered by
    (dominant share plus decayed past use, over its weight: lower goes first)."""
    quota: dict[tuple[str, str], float] = {}
    allocated: dict[tuple[str, str], float] = {}
    borrowed: dict[tuple[str, str], float] = {}
    types = working.cap.type_names
    for tenant, tp in policy.tenants.items():
        if tp.quotas is None:
            continue
        for t in types:
            nominal = tp.nominal(t)
            if nominal is not None:
                quota[(tenant, t)] = nominal
    book = working.quota
    for (tenant, t), used in book.used.items():
        allocated[(str(tenant), t)] = used
        lent = book.borrowing(tenant, t)
        if lent > 0:
            borrowed[(str(tenant), t)] = lent
    shares = working.shares
    active: set[TenantId] = {t for t, rate in shares.rates().items() if rate > 0}
    active.update(job.tenant for job in working.queues.jobs())
    tenants = sorted(set(active) | {TenantId(t) for t in policy.tenants})
    weights = {t: _weight(policy, t) for t in active}
    total_weight = sum(weights.values())
    dominant = {}
    fair = {}
    ordering = {}
    for tenant in tenants:
        name = str(tenant)
        dominant[name] = _dominant(shares.allocated.get(tenant, {}), shares.totals)
        fair[name] = weights[tenant] / total_weight if tenant in weights else 0.0
        ordering[name] = shares.share(tenant)
    return TenantFigures(quota, allocated, borrowed, dominant, fair, ordering)


def fleet_figures(cap: Capacity) -> FleetFigures:
    """Accelerators by cluster, type and state (allocated, idle, held for a waiting gang,
    unhealthy), how many replicas of each SLOT_SIZES size could start now on untouched devices
    of healthy nodes not held for a gang, and the fragmentation of what is free."""
    accelerators: dict[tuple[str, str, str], float] = {}
    slots: dict[tuple[str, str, str], int] = {}
    fragmentation: dict[tuple[str, str], float] = {}
    if not cap.nodes:
        return FleetFigures()
    devices = cap.devices.astype(np.float64)
    free = cap.free_milli.astype(np.float64) / MILLI
    used = devices - free
    healthy = cap.usable
    held = cap.held >= 0
    idle_whole = np.where(healthy & ~held, cap.free_whole, 0)
    whole_node = healthy & ~held & (cap.free_whole == cap.devices)
    for c, cluster in enumerate(cap.cluster_names):
        for t, accelerator_type in enumerate(cap.type_names):
            here = (cap.cluster_of == c) & (cap.type_of == t)
            if not here.any():
                continue
            key = (str(cluster), accelerator_type)
            states = {
                "allocated": float(used[here & healthy].sum()),
                "idle": float(free[here & healthy & ~held].sum()),
                "held": float(free[here & healthy & held].sum()),
                "unhealthy": float(devices[here & ~healthy].sum()),
            }
            for name, amount in states.items():
                accelerators[(*key, name)] = amount
            for size in SLOT_SIZES:
                slots[(*key, str(size))] = int((idle_whole[here] // size).sum())
            free_here = float(free[here & healthy & ~held].sum())
            on_free_nodes = float(devices[here & whole_node].sum())
            fragmentation[key] = 1.0 - on_free_nodes / free_here if free_here > 0 else 0.0
    return FleetFigures(accelerators, slots, fragmentation)


def _weight(policy: Policy, tenant: TenantId) -> float:
    tp = policy.tenant(tenant)
    return tp.weight if tp is not None else 1.0


def _dominant(mine: Mapping[str, float], totals: Mapping[str, float]) -> float:
    return max(
        (amount / totals[r] for r, amount in mine.items() if totals.get(r, 0) > 0), default=0.0
    )
