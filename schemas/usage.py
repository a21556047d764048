"""Payloads of the metering topics: `usage.tick` (the stream finance reads) and
`budget.exceeded` (budget alerts go out on `alert.raised` as schemas.health.AlertRaised).
docs/metering.md explains how ticks are cut and priced.

Seconds are fleet seconds: on the simulated fleet, virtual seconds (QM_TIME_SCALE of them per
wall-clock second); on a real cluster the two are the same. Timestamps are wall-clock UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum

from pydantic import Field

from schemas.bounds import Amount
from schemas.events import Payload


def budget_month(at: datetime) -> str:
    """The calendar month (UTC) a budget counts an instant in: 'YYYY-MM'."""
    at = at.astimezone(UTC) if at.tzinfo else at
    return f"{at.year:04d}-{at.month:02d}"


class TickKind(StrEnum):
    INTERVAL = "interval"  # a running allocation over (part of) one interval of the grid
    CLOSE = "close"  # the last tick of a run; negative seconds are a credit (see docs)
    IDLE = "idle"  # capacity of a pool nobody was allocated over one interval


class UsageTick(Payload):
    """Accelerator-seconds and cost of one allocation (or one pool's idle capacity) over one
    interval. `tick_id` is the natural key: a consumer that sees it twice counts it once."""

    tick_id: str = Field(
        description="Unique key: '<job>#<attempt>/<interval>/<tier>' for interval ticks, "
        "'<job>#<attempt>/close/<tier>' for the closing tick, "
        "'idle/<cluster>/<type>/<tier>/<interval>/<tenant>' for idle capacity."
    )
    kind: TickKind
    run_id: str = Field(description="'<job_id>#<attempt>' (one run of a job); 'idle/...' for idle.")
    job_id: str | None = None
    attempt: int | None = None
    tenant: str = Field(
        description="Who pays. Idle ticks: the overhead tenant, or (chargeback) "
        "each tenant in proportion to its usage of the pool."
    )
    project: str
    user: str
    cluster: str
    accelerator_type: str
    price_tier: str = Field(description="reserved | on_demand | spot")
    count: float = Field(
        description="Accelerators of this allocation in this tier (may be a "
        "fraction). Idle ticks: the average idle accelerators of the interval."
    )
    interval_s: float = Field(description="Length of the metering grid's intervals, fleet seconds.")
    interval_index: int = Field(
        description="Interval of the grid this tick falls in: fleet time "
        "since the epoch // interval_s (the same grid for every run)."
    )
    interval_start: datetime = Field(description="Wall-clock start of the metered span.")
    interval_end: datetime = Field(description="Wall-clock end of the metered span.")
    start_offset_s: float = Field(
        description="Fleet seconds since the run started where this "
        "tick's span begins (0 for idle ticks)."
    )
    end_offset_s: float = Field(description="... and where it ends.")
    seconds: float = Field(description="end_offset_s - start_offset_s, in fleet seconds.")
    accelerator_seconds: Amount = Field(
        description="count x seconds (rounded so that the ticks "
        "of a run add up exactly to its total)."
    )
    unit_price: float = Field(description="Price per accelerator-hour.")
    cost: Amount = Field(description="accelerator_seconds / 3600 x unit_price, same rounding rule.")
    currency: str = "USD"
    outcome: str | None = Field(
        default=None,
        description="On close ticks, how the run ended: succeeded, failed, canceled or preempted.",
    )


class BudgetUnit(StrEnum):
    ACCELERATOR_HOURS = "accelerator_hours"
    CURRENCY = "currency"


class Enforcement(StrEnum):
    NOTIFY = "notify"  # alerts only
    DEPRIORITIZE = "deprioritize"  # the scheduler lowers the tenant's fair-share weight
    BLOCK = "block"  # the queue rejects new submissions (reason budget_exhausted)


class BudgetExceeded(Payload):
    """A tenant (or one of its projects) crossed a threshold of its monthly budget. Emitted
    once per budget, month and threshold."""

    budget_id: str
    tenant: str
    project: str | None = Field(default=None, description="None: the budget of the whole tenant.")
    month: str = Field(description="Calendar month (UTC) the budget applies to, 'YYYY-MM'.")
    unit: BudgetUnit
    limit: float
    used: float = Field(description="Consumption in `unit` when the threshold was crossed.")
    threshold_pct: float = Field(description="The threshold crossed, percent of the limit.")
    enforcement: Enforcement
    currency: str | None = None
    weight_factor: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="For deprioritize: multiply the tenant's fair-share weight (only lowers it).",
    )
    crossed_at: datetime
    message: str
