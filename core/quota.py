"""Quotas: each tenant runs up to its nominal quota per accelerator type and may borrow what its
cohort lends, within limits; what it borrows is marked so that the lender can reclaim it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from core.model import Allocation, JobId, TenantId
from core.policy import Policy, TenantPolicy
from core.reasons import Miss, ReasonCode


@dataclass(frozen=True)
class Admission:
    """Quota allows the job on this type; `guaranteed` when it stays within nominal quota."""

    accelerator_type: str
    guaranteed: bool


@dataclass
class QuotaBook:
    policy: Policy
    used: dict[tuple[TenantId, str], float]
    # What each tenant's cohort can lend it, per type, until the next charge changes it.
    _lendable: dict[tuple[str, str], float] = field(default_factory=dict)
    _members: dict[str, tuple[TenantPolicy, ...]] = field(default_factory=dict)
    # Moves on with every charge: an answer of `admit` holds while it stays the same.
    version: int = 0

    @classmethod
    def build(cls, running: Iterable[tuple[Allocation, str]], policy: Policy) -> QuotaBook:
        """`running` pairs each allocation with the accelerator type it runs on."""
        book = cls(policy=policy, used={})
        for alloc, accelerator_type in running:
            book.charge(alloc.job.tenant, accelerator_type, alloc.job.total_accelerators)
        return book

    def charge(self, tenant: TenantId, accelerator_type: str, amount: float) -> None:
        key = (tenant, accelerator_type)
        self.used[key] = self.used.get(key, 0.0) + amount
        self._lendable.clear()
        self.version += 1

    def admit(self, tenant: TenantId, accelerator_type: str, amount: float) -> Admission | Miss:
        tp = self.policy.tenant(tenant)
        nominal = tp.nominal(accelerator_type) if tp is not None else None
        if tp is None or nominal is None:
            return Admission(accelerator_type, guaranteed=True)
        used = self.used.get((tenant, accelerator_type), 0.0)
        if used + amount <= nominal + 1e-9:
            return Admission(accelerator_type, guaranteed=True)
        borrowed_after = used + amount - nominal
        if borrowed_after > tp.max_borrow(accelerator_type) + 1e-9:
            return Miss(
                ReasonCode.BORROW_LIMIT,
                f"{tenant} would borrow {borrowed_after:g} {accelerator_type}, above its "
                f"borrowing limit of {tp.max_borrow(accelerator_type):g}",
            )
        available = self.lendable(tp, accelerator_type)
        if borrowed_after > available + 1e-9:
            return Miss(
                ReasonCode.QUOTA_EXHAUSTED, self._exhausted(tp, accelerator_type, available)
            )
        return Admission(accelerator_type, guaranteed=False)

    def lendable(self, tp: TenantPolicy, accelerator_type: str) -> float:
        """What the rest of `tp`'s cohort can still lend it: unused nominal within each member's
        lending limit, minus what the others already borrow."""
        if tp.cohort is None:
            return 0.0
        key = (tp.name, accelerator_type)
        known = self._lendable.get(key)
        if known is not None:
            return known
        members = self._members.get(tp.cohort)
        if members is None:
            members = self._members[tp.cohort] = self.policy.cohort_members(tp.cohort)
        spare = 0.0
        for member in members:
            if member.name == tp.name:
                continue
            nominal = member.nominal(accelerator_type) or 0.0
            used = self.used.get((TenantId(member.name), accelerator_type), 0.0)
            spare += min(member.max_lend(accelerator_type), max(0.0, nominal - used))
            spare -= max(0.0, used - nominal)
        self._lendable[key] = max(0.0, spare)
        return self._lendable[key]

    def _exhausted(self, tp: TenantPolicy, accelerator_type: str, available: float) -> str:
        used = self.used.get((TenantId(tp.name), accelerator_type), 0.0)
        quota = (
            f"{tp.name}'s {accelerator_type} quota is exhausted "
            f"({used:g} of {tp.nominal(accelerator_type) or 0:g} in use)"
        )
        if tp.cohort is None:
            return f"{quota} and it belongs to no cohort to borrow from"
        if available <= 0:
            return f"{quota} and cohort {tp.cohort} has nothing to lend"
        return f"{quota} and cohort {tp.cohort} can lend only {available:g}"

    def at_nominal(self, tenant: TenantId, accelerator_types: Iterable[str]) -> bool:
        """Whether any further accelerator of these types would make `tenant` borrow."""
        tp = self.policy.tenant(tenant)
        if tp is None or tp.quotas is None:
            return False
        return all(
            self.used.get((tenant, t), 0.0) >= (tp.nominal(t) or 0.0) - 1e-9
            for t in accelerator_types
        )

    def may_guarantee(self, tenant: TenantId, types: Iterable[str], amount: float) -> bool:
        """Whether `amount` more of some of these types would still be within nominal quota."""
        tp = self.policy.tenant(tenant)
        if tp is None or tp.quotas is None:
            return True
        for t in types:
            nominal = tp.nominal(t)
            if nominal is None or self.used.get((tenant, t), 0.0) + amount <= nominal + 1e-9:
                return True
        return False

    def borrowing(self, tenant: TenantId, accelerator_type: str) -> float:
        tp = self.policy.tenant(tenant)
        nominal = tp.nominal(accelerator_type) if tp is not None else None
        if nominal is None:
            return 0.0
        return max(0.0, self.used.get((tenant, accelerator_type), 0.0) - nominal)


def guaranteed_jobs(
    running: Mapping[JobId, Allocation], types_of: Mapping[JobId, str], policy: Policy
) -> Mapping[JobId, bool]:
    """Which running jobs sit inside their tenant's nominal quota (True) and which on borrowed
    capacity (False), given the accelerator type each occupies; jobs of tenants without quotas
    are left out (always inside). A tenant's highest-priority, oldest jobs fill the nominal
    quota first, so reclaim takes back its newest, lowest-priority work."""
    limited = {name for name, tp in policy.tenants.items() if tp.quotas is not None}
    if not limited:
        return {}
    by_owner: dict[tuple[TenantId, str], list[Allocation]] = {}
    for job_id, alloc in running.items():
        accelerator_type = types_of.get(job_id)
        if accelerator_type is not None and alloc.job.tenant in limited:
            by_owner.setdefault((alloc.job.tenant, accelerator_type), []).append(alloc)
    out: dict[JobId, bool] = {}
    for (tenant, accelerator_type), allocs in sorted(by_owner.items()):
        tp = policy.tenant(tenant)
        nominal = tp.nominal(accelerator_type) if tp is not None else None
        allocs.sort(key=lambda a: (-policy.rank(a.job.priority_class), a.start_time, a.job.job_id))
        filled = 0.0
        for alloc in allocs:
            filled += alloc.job.total_accelerators
            out[alloc.job.job_id] = nominal is None or filled <= nominal + 1e-9
    return out
