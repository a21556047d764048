"""Fair share between tenants: weighted dominant-resource share of what each tenant runs now,
plus its exponentially decayed past usage, so a team that ran a lot yesterday yields today.

Accelerators count by effective throughput, not by number: an accelerator of relative speed 3
is three reference accelerators, in what a tenant holds, in the fleet's total and in past usage
(reference accelerator-seconds). A tenant on the fastest devices yields to one holding as many
slow ones. CPU and memory are resources of their own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from core.capacity import EPS, Capacity
from core.model import Allocation, JobRequest, TenantId
from core.policy import Policy

CPU = "cpu"
MEMORY = "memory"
# Accelerators of every type, in reference accelerators (count x relative speed).
ACCELERATORS = "accelerators"


def decay(value: float, elapsed_s: float, half_life_s: float) -> float:
    """`value` after `elapsed_s` of exponential decay; the meter and the simulator both use it."""
    if half_life_s <= 0:
        return 0.0
    factor: float = 0.5 ** (max(elapsed_s, 0.0) / half_life_s)
    return value * factor


def accrue_rates(
    usage: Mapping[TenantId, float],
    rates: Mapping[TenantId, float],
    elapsed_s: float,
    half_life_s: float,
) -> dict[TenantId, float]:
    """Decays `usage` by `elapsed_s` and adds what each tenant held in it: `rates` are
    reference accelerators per tenant (`ShareBook.rates`), so the time taken does not grow with
    the running work. The live scheduler calls this on every cycle and feeds the result back as
    `Snapshot.usage`; adding before or after the decay differs by at most one interval."""
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
    # Relative speed of each accelerator type (of its first node by id).
    speeds: dict[str, float]

    @classmethod
    def build(
        cls,
        cap: Capacity,
        running: Iterable[tuple[Allocation, str]],
        usage: Mapping[TenantId, float],
        policy: Policy,
    ) -> ShareBook:
        """`running` pairs each allocation with the accelerator type it occupies."""
        totals: dict[str, float] = {ACCELERATORS: 0.0, CPU: 0.0, MEMORY: 0.0}
        speeds: dict[str, float] = {}
        for n in cap.nodes:
            speed = speeds.setdefault(n.accelerator.type, n.accelerator.relative_speed)
            if n.healthy:
                totals[ACCELERATORS] += n.accelerators * speed
                totals[CPU] += n.cpu
                totals[MEMORY] += n.memory_gb
        book = cls(totals=totals, allocated={}, past={}, policy=policy, speeds=speeds)
        book.set_usage(usage)
        for alloc, accelerator_type in running:
            book.charge(alloc.job, accelerator_type)
        return book

    def set_usage(self, usage: Mapping[TenantId, float]) -> None:
        """Replaces decayed past usage (reference accelerator-seconds per tenant)."""
        # A tenant that used the whole fleet forever has decayed usage of size x mean lifetime.
        lifetime = self.policy.fair_share.half_life_s / math.log(2)
        scale = max(self.totals[ACCELERATORS], 1.0) * lifetime
        self.past = {t: v / scale for t, v in usage.items()} if lifetime > 0 else {}

    def charge(self, job: JobRequest, accelerator_type: str, sign: float = 1.0) -> None:
        """Adds (or, with `sign` -1, takes back) what `job` holds. What is left of amounts
        charged and taken back in another order (0.3 + 1.0 - 0.3 - 1.0) is rounding, not
        use: it is snapped to zero, or a tenant holding nothing would have a share above
        another's by 1e-16 and go after it, depending on the order jobs left in."""
        mine = self.allocated.setdefault(job.tenant, {})
        work = job.total_accelerators * self.speeds.get(accelerator_type, 1.0)
        for resource, amount in (
            (ACCELERATORS, work),
            (CPU, job.replicas * job.cpu),
            (MEMORY, job.replicas * job.memory_gb),
        ):
            total = mine.get(resource, 0.0) + sign * amount
            mine[resource] = 0.0 if abs(total) < EPS else total

    def rates(self) -> dict[TenantId, float]:
        """Reference accelerators each tenant holds now: what its usage grows by per second."""
        return {tenant: mine.get(ACCELERATORS, 0.0) for tenant, mine in self.allocated.items()}

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
