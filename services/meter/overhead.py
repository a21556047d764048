"""Idle capacity: the accelerator-seconds of each pool nobody was allocated in an interval, as
idle ticks. Pure.

Showback reports idle capacity as platform overhead (one tick for the overhead tenant);
chargeback spreads the idle capacity of costed tiers over the tenants that used the pool in
that interval, in proportion to their usage, so their bills add up to the pool's whole cost.
Idle ticks of tiers that cost nothing while unused (spot, on-demand that is scaled away) are
still reported, at price 0, so fleet efficiency sees them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from schemas.usage import TickKind
from services.meter.pricing import Pool, PriceKey
from services.meter.ticks import MICRO, Grid, Tick, rdiv

IDLE = "_idle"  # project and user of idle ticks


class OverheadMode(StrEnum):
    SHOWBACK = "showback"
    CHARGEBACK = "chargeback"


@dataclass(frozen=True)
class OverheadPolicy:
    mode: OverheadMode = OverheadMode.SHOWBACK
    tenant: str = "platform"  # who carries idle capacity in showback (and unused pools)
    costed_tiers: frozenset[str] = frozenset({"reserved"})


# pool -> tenant -> accelerator-seconds (millionths) allocated in one interval
Allocated = Mapping[PriceKey, Mapping[str, int]]
# accelerator-seconds_u x price_u / _IDLE_COST = cost in millionths
_IDLE_COST = 3600 * MICRO


def usage_by_interval(ticks: Iterable[Tick]) -> dict[tuple[int, str, str, str, str], int]:
    """Usage accelerator-seconds of new ticks per (interval, cluster, type, tier, tenant)."""
    out: dict[tuple[int, str, str, str, str], int] = {}
    for t in ticks:
        if t.kind is not TickKind.IDLE:
            key = (t.interval_index, t.cluster, t.accelerator_type, t.price_tier, t.tenant)
            out[key] = out.get(key, 0) + t.accelerator_seconds_u
    return out


def split(amount: int, weights: Mapping[str, int]) -> dict[str, int]:
    """`amount` in proportion to `weights` (all positive); the largest weight takes the
    rounding remainder so the parts add up to `amount` exactly."""
    total = sum(weights.values())
    names = sorted(weights, key=lambda n: (-weights[n], n))
    parts = {n: rdiv(amount * weights[n], total) for n in names[1:]}
    parts[names[0]] = amount - sum(parts.values())
    return parts


def idle_ticks(
    index: int, pools: list[Pool], allocated: Allocated, grid: Grid, policy: OverheadPolicy
) -> list[Tick]:
    """Idle ticks of interval `index` for every pool with unallocated capacity."""
    out: list[Tick] = []
    for pool in sorted(pools, key=lambda p: p.key):
        used = {t: s for t, s in allocated.get(pool.key, {}).items() if s > 0}
        capacity = pool.accelerators * grid.interval_u  # accelerator-seconds, in millionths
        idle = capacity - sum(used.values())
        if idle <= 0:
            continue
        costed = pool.price_tier in policy.costed_tiers
        price = pool.unit_price_u if costed else 0
        if policy.mode is OverheadMode.CHARGEBACK and costed and used:
            parts = split(idle, used)
        else:
            parts = {policy.tenant: idle}
        for tenant, seconds in sorted(parts.items()):
            out.append(_tick(index, pool, tenant, seconds, price, grid))
    return out


def _tick(
    index: int, pool: Pool, tenant: str, accelerator_seconds_u: int, price_u: int, grid: Grid
) -> Tick:
    run_id = f"idle/{pool.cluster}/{pool.accelerator_type}"
    return Tick(
        tick_id=f"{run_id}/{pool.price_tier}/{index}/{tenant}",
        kind=TickKind.IDLE,
        run_id=run_id,
        job_id=None,
        attempt=None,
        tenant=tenant,
        project=IDLE,
        user=IDLE,
        cluster=pool.cluster,
        accelerator_type=pool.accelerator_type,
        price_tier=pool.price_tier,
        count_u=rdiv(accelerator_seconds_u * MICRO, grid.interval_u),
        interval_index=index,
        interval_start=grid.wall(grid.start(index)),
        interval_end=grid.wall(grid.start(index + 1)),
        start_offset_u=0,
        end_offset_u=grid.interval_u,
        seconds_u=grid.interval_u,
        accelerator_seconds_u=accelerator_seconds_u,
        unit_price_u=price_u,
        cost_u=rdiv(accelerator_seconds_u * price_u, _IDLE_COST),
    )
