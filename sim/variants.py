"""The policies a simulation compares, each derived from the one policy file so that only the
named difference changes: ordering, backfill and preemption."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from core.policy import (
    Backfill,
    BackfillMode,
    LevelMode,
    OrderingMode,
    Policy,
    ServiceLevels,
    TenantPolicy,
)

VARIANTS = ("fifo", "fifo-backfill", "default", "las", "learned")
# Also known by name, not compared by default: the file without repacking, and fair share
# alone (neither service levels nor repacking).
OTHER_VARIANTS = ("no-repack", "fair-share")


class UnknownVariant(ValueError):
    pass


def variant(base: Policy, name: str) -> Policy:
    """`base` as the named policy: 'default' is the file itself; the others keep its tenants,
    fleet knobs and placement, turn service levels and repacking off and set ordering,
    backfill and preemption; 'learned' is the file with learned service levels on,
    'no-repack' the file with repacking off, 'fair-share' the file with both off."""
    no_preemption = replace(base.preemption, enabled=False)
    if name == "default":
        return base
    if name == "learned":
        return replace(
            base,
            service_levels=replace(base.service_levels, mode=LevelMode.LEARNED),
            preemption=replace(base.preemption, enabled=True),
        )
    base = replace(base, preemption=replace(base.preemption, repack=False))
    if name == "no-repack":
        return base
    base = replace(base, service_levels=ServiceLevels())
    if name == "fair-share":
        return base
    if name == "fifo":
        # Strict FIFO: the head of the line blocks everything behind it.
        return replace(
            base,
            ordering=OrderingMode.FIFO,
            backfill=replace(base.backfill, mode=BackfillMode.OFF),
            preemption=no_preemption,
        )
    if name == "fifo-backfill":
        return replace(
            base,
            ordering=OrderingMode.FIFO,
            backfill=replace(base.backfill, mode=BackfillMode.GREEDY),
            preemption=no_preemption,
        )
    if name == "las":
        # Tiresias-like: least attained service first, preempting the most-served work.
        return replace(
            base,
            ordering=OrderingMode.LAS,
            backfill=Backfill(mode=BackfillMode.GREEDY),
            preemption=replace(base.preemption, enabled=True),
        )
    known = ", ".join(VARIANTS + OTHER_VARIANTS)
    raise UnknownVariant(f"unknown policy {name!r}; choose from {known}")


def with_quotas(base: Policy, nominal: Mapping[str, float], cohort: str = "pool") -> Policy:
    """`base` with one tenant per entry, all in one cohort, each with a nominal quota on any
    accelerator type; tenants the mapping does not list run on borrowed capacity only."""
    tenants = dict(base.tenants)
    for name, amount in sorted(nominal.items()):
        tenants[name] = TenantPolicy(name=name, cohort=cohort, quotas={"*": amount})
    return replace(base, tenants=tenants)
