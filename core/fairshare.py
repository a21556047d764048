"""Fair share between tenants: weighted dominant-resource share of what each tenant runs now,
plus its exponentially decayed past usage, so a team that ran a lot yesterday yields today.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from core.capacity import Capacity
from core.model import Allocation, JobRequest, TenantId
from core.policy import Policy

CPU = "cpu"
MEMORY = "memory"


def decay(value: float, elapsed_s: float, half_life_s: float) -> float:
    """`value` after `elapsed_s` of exponential decay; the meter and the simulator both use it."""
    if half_life_s <= 0:
        return 0.0
    factor: float = 0.5 ** (max(elapsed_s, 0.0) / half_life_s)
    return value * factor


def accrue(
    usage: Mapping[TenantId, float],
    running: Iterable[Allocation],
    elapsed_s: float,
    half_life_s: float,
) -> dict[TenantId, float]:
    """Decays `usage` by `elapsed_s` and adds the accelerator-seconds `running` consumed in it.

    The live scheduler calls this on every cycle (or on each usage tick) and feeds the result back
    as `Snapshot.usage`; adding before or after the decay differs by at most one interval.
    """
    out = {t: decay(v, elapsed_s, half_life_s) for t, v in usage.items()}
    for alloc in running:
        spent = sum(r.accelerators for r in alloc.replicas) * max(elapsed_s, 0.0)
        out[alloc.job.tenant] = out.get(alloc.job.tenant, 0.0) + spent
    return out


def accrue_rates(
    usage: Mapping[TenantId, float],
    rates: Mapping[TenantId, float],
    elapsed_s: float,
    half_life_s: float,
) -> dict[TenantId, float]:
    """`accrue` from accelerators held per tenant instead of from every allocation: the same
    figures, in time that does not grow with the running work."""
    out = {t: decay(v, elapsed_s, half_life_s) for t, v in usage.items()}
    for tenant, rate in rates.items():
        if rate:
            out[tenant] = out.get(tenant, 0.0) + rate * max(elapsed_s, 0.0)
    return out


@dataclass
class ShareBook:
    """Each tenant's current share, updated as the cycle places work."""

    totals: dict[str, float]
    allocated: dict[TenantId, dict[str, float]]
    past: dict[TenantId, float]
    policy: Policy

    @classmethod
    def build(
        cls,
        cap: Capacity,
        running: Iterable[tuple[Allocation, str]],
        usage: Mapping[TenantId, float],
        policy: Policy,
    ) -> ShareBook:
        """`running` pairs each allocation with the accelerator type it occupies."""
        totals: dict[str, float] = {CPU: 0.0, MEMORY: 0.0}
        for n in cap.nodes:
            if n.healthy:
                totals[n.accelerator.type] = totals.get(n.accelerator.type, 0.0) + n.accelerators
                totals[CPU] += n.cpu
                totals[MEMORY] += n.memory_gb
        book = cls(totals=totals, allocated={}, past={}, policy=policy)
        book.set_usage(usage)
        for alloc, accelerator_type in running:
            book.charge(alloc.job, accelerator_type)
        return book

    def set_usage(self, usage: Mapping[TenantId, float]) -> None:
        """Replaces decayed past usage (accelerator-seconds per tenant)."""
        # A tenant that used the whole fleet forever has decayed usage of size x mean lifetime.
        lifetime = self.policy.fair_share.half_life_s / math.log(2)
        fleet = sum(v for k, v in self.totals.items() if k not in (CPU, MEMORY))
        scale = max(fleet, 1.0) * lifetime
        self.past = {t: v / scale for t, v in usage.items()} if lifetime > 0 else {}

    def charge(self, job: JobRequest, accelerator_type: str, sign: float = 1.0) -> None:
        mine = self.allocated.setdefault(job.tenant, {})
        mine[accelerator_type] = mine.get(accelerator_type, 0.0) + sign * job.total_accelerators
        mine[CPU] = mine.get(CPU, 0.0) + sign * job.replicas * job.cpu
        mine[MEMORY] = mine.get(MEMORY, 0.0) + sign * job.replicas * job.memory_gb

    def rates(self) -> dict[TenantId, float]:
        """Accelerators each tenant holds now (all types): what its usage grows by per second."""
        return {
            tenant: sum(v for k, v in mine.items() if k not in (CPU, MEMORY))
            for tenant, mine in self.allocated.items()
        }

    def share(self, tenant: TenantId) -> float:
        mine = self.allocated.get(tenant, {})
        dominant = max(
            (amount / self.totals[r] for r, amount in mine.items() if self.totals.get(r, 0) > 0),
            default=0.0,
        )
        tp = self.policy.tenant(tenant)
        weight = tp.weight if tp is not None else 1.0
        past = self.policy.fair_share.usage_weight * self.past.get(tenant, 0.0)
        return (dominant + past) / weight
