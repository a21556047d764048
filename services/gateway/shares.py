"""Each tenant's standing against its quota and its fair share, from what its jobs hold and
wait for. Pure: services/gateway/queues.py reads the figures and calls it.

- usage: accelerators its placed, running and preempting jobs hold, by type;
- borrowed: usage above its nominal quota of that type;
- lent: what its cohort borrows, attributed to the members that have unused nominal quota (within
  their lending limits) in proportion to how much each could lend; approximate, since the
  scheduler does not say whose quota a borrower runs on;
- fair share: its weight over the weights of every tenant with demand (held or pending work);
  actual share: its usage over all usage (accelerators of any type). The scheduler itself orders
  by weighted dominant-resource share with decayed past usage; this is the plain view of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from core.policy import ANY_TYPE, Policy, TenantPolicy

_EPS = 1e-9


@dataclass
class Load:
    """What one tenant's jobs hold and wait for, by accelerator type."""

    usage: dict[str, float] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)

    @property
    def held(self) -> float:
        return sum(self.usage.values())

    @property
    def has_demand(self) -> bool:
        return self.held > _EPS or any(v > _EPS for v in self.pending.values())


@dataclass(frozen=True)
class TypeStanding:
    accelerator_type: str
    nominal: float | None  # None: no quota applies (no quota set, or not one type)
    usage: float
    borrowed: float
    lent: float


@dataclass(frozen=True)
class Standing:
    tenant: str
    weight: float
    cohort: str | None
    types: tuple[TypeStanding, ...]
    usage: float
    fair_share: float | None  # None while it has no demand
    actual_share: float


def nominal(tp: TenantPolicy | None, accelerator_type: str) -> float | None:
    """Its nominal quota of one real type; None for `any` and for several types joined by `|`
    (a pending job that accepts several types), which no quota names."""
    if tp is None or accelerator_type == "any" or "|" in accelerator_type:
        return None
    return tp.nominal(accelerator_type)


def _lendable(tp: TenantPolicy, load: Load, accelerator_type: str) -> float:
    quota = nominal(tp, accelerator_type)
    if quota is None:
        return 0.0
    unused = max(0.0, quota - load.usage.get(accelerator_type, 0.0))
    return min(tp.max_lend(accelerator_type), unused)


def _borrowed(tp: TenantPolicy | None, load: Load, accelerator_type: str) -> float:
    quota = nominal(tp, accelerator_type)
    if quota is None:
        return 0.0
    return max(0.0, load.usage.get(accelerator_type, 0.0) - quota)


def lent(policy: Policy, loads: Mapping[str, Load], tenant: str, accelerator_type: str) -> float:
    """The part of its cohort's borrowing of this type put down to `tenant`'s unused quota."""
    tp = policy.tenant(tenant)
    if tp is None or tp.cohort is None:
        return 0.0
    members = policy.cohort_members(tp.cohort)
    empty = Load()
    borrowed = sum(_borrowed(m, loads.get(m.name, empty), accelerator_type) for m in members)
    lendable = {m.name: _lendable(m, loads.get(m.name, empty), accelerator_type) for m in members}
    pool = sum(lendable.values())
    if pool <= _EPS or borrowed <= _EPS:
        return 0.0
    return min(borrowed, pool) * lendable[tenant] / pool


def _types(
    policy: Policy, loads: Mapping[str, Load], tenant: str, fleet_types: Iterable[str]
) -> list[str]:
    """The types its quotas name (every type of the fleet under a `*` quota), it holds, it waits
    for, or it lends."""
    tp = policy.tenant(tenant)
    load = loads.get(tenant, Load())
    quotas = (tp.quotas or {}) if tp is not None else {}
    named = set(quotas) - {ANY_TYPE}
    if ANY_TYPE in quotas:
        named |= set(fleet_types)
    held_anywhere = {a for other in loads.values() for a in other.usage}
    lending = {a for a in held_anywhere - named if lent(policy, loads, tenant, a) > _EPS}
    return sorted(named | lending | set(load.usage) | set(load.pending))


def standings(
    policy: Policy,
    loads: Mapping[str, Load],
    tenants: Iterable[str] | None = None,
    fleet_types: Iterable[str] = (),
) -> list[Standing]:
    """The standing of `tenants` (default: every tenant of the policy or with work), computed
    against every tenant's load; `fleet_types` are the fleet's accelerator types."""
    fleet_types = tuple(fleet_types)
    everyone = sorted(set(policy.tenants) | set(loads))
    empty = Load()
    demand = [t for t in everyone if loads.get(t, empty).has_demand]
    weights = {t: _weight(policy, t) for t in everyone}
    demand_weight = sum(weights[t] for t in demand)
    total_held = sum(loads.get(t, empty).held for t in everyone)
    out = []
    for t in everyone if tenants is None else sorted(set(tenants)):
        tp = policy.tenant(t)
        load = loads.get(t, empty)
        types = tuple(
            TypeStanding(
                accelerator_type=a,
                nominal=nominal(tp, a),
                usage=load.usage.get(a, 0.0),
                borrowed=_borrowed(tp, load, a),
                lent=lent(policy, loads, t, a),
            )
            for a in _types(policy, loads, t, fleet_types)
        )
        fair = weights.get(t, _weight(policy, t)) / demand_weight if t in demand else None
        out.append(
            Standing(
                tenant=t,
                weight=weights.get(t, _weight(policy, t)),
                cohort=tp.cohort if tp is not None else None,
                types=types,
                usage=load.held,
                fair_share=fair,
                actual_share=load.held / total_held if total_held > _EPS else 0.0,
            )
        )
    return out


def _weight(policy: Policy, tenant: str) -> float:
    tp = policy.tenant(tenant)
    return tp.weight if tp is not None else 1.0
