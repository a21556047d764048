"""The tick math: cutting a run into usage ticks on the metering grid, and pricing them. Pure.

Time is fleet time (virtual seconds on the simulated fleet): a wall-clock instant t maps to
`t x time_scale` seconds since the epoch, and the grid cuts that line every `interval_s`
seconds, so every run's ticks fall in the same intervals. A run occupies
[start_v, start_v + ran_s); its ticks are that span cut at the grid's edges.

Amounts are Decimals. A tick's accelerator-seconds and cost are the difference of the run's
*cumulative* amounts (rounded to a millionth) at its two ends, so however a run is cut, its
ticks add up exactly to count x ran_s and to the cost of that, rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import ROUND_FLOOR, ROUND_HALF_EVEN, Decimal

from schemas.usage import TickKind

MICRO = Decimal("0.000001")
HOUR = Decimal(3600)
ZERO = Decimal(0)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MICROSECOND = timedelta(microseconds=1)


def q6(value: Decimal) -> Decimal:
    return value.quantize(MICRO, rounding=ROUND_HALF_EVEN)


def dec(value: float | int | str | Decimal) -> Decimal:
    """A Decimal with the digits a person reads: 0.1 is 0.1, not its binary neighbour."""
    return value if isinstance(value, Decimal) else Decimal(str(value))


@dataclass(frozen=True)
class Grid:
    """The metering grid: `interval_s` fleet seconds per interval, `time_scale` fleet seconds
    per wall-clock second."""

    interval_s: Decimal
    time_scale: Decimal

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.time_scale <= 0:
            raise ValueError("interval and time scale must be positive")

    def virtual(self, wall: datetime) -> Decimal:
        micros = (wall - EPOCH) // _ONE_MICROSECOND
        return q6(Decimal(micros) * self.time_scale / 1_000_000)

    def wall(self, virtual: Decimal) -> datetime:
        micros = (virtual * 1_000_000 / self.time_scale).to_integral_value(ROUND_HALF_EVEN)
        return EPOCH + timedelta(microseconds=int(micros))

    def index(self, virtual: Decimal) -> int:
        return int((virtual / self.interval_s).to_integral_value(ROUND_FLOOR))

    def start(self, index: int) -> Decimal:
        return self.interval_s * index

    def closed_through(self, now: datetime) -> int:
        """The last interval that has ended by wall-clock `now`."""
        return self.index(self.virtual(now)) - 1


@dataclass(frozen=True)
class Share:
    """The part of an allocation on nodes of one price tier."""

    price_tier: str
    count: Decimal  # accelerators (a fraction for a shared device)
    unit_price: Decimal  # per accelerator-hour


@dataclass(frozen=True)
class Run:
    """One run of a job (job id + attempt) as the meter bills it."""

    job_id: str
    attempt: int
    tenant: str
    project: str
    user: str
    cluster: str
    accelerator_type: str
    shares: tuple[Share, ...]
    start_v: Decimal  # fleet time it started (seconds since the epoch)
    billed_s: Decimal = ZERO  # fleet seconds since its start already billed

    @property
    def run_id(self) -> str:
        return f"{self.job_id}#{self.attempt}"


@dataclass(frozen=True)
class Tick:
    tick_id: str
    kind: TickKind
    run_id: str
    job_id: str | None
    attempt: int | None
    tenant: str
    project: str
    user: str
    cluster: str
    accelerator_type: str
    price_tier: str
    count: Decimal
    interval_index: int
    interval_start: datetime
    interval_end: datetime
    start_offset_s: Decimal
    end_offset_s: Decimal
    seconds: Decimal
    accelerator_seconds: Decimal
    unit_price: Decimal
    cost: Decimal
    outcome: str | None = None


def spans(
    start_v: Decimal, a: Decimal, b: Decimal, grid: Grid
) -> list[tuple[int, Decimal, Decimal]]:
    """Run-relative [a, b) cut at the grid's edges: (interval index, from, to) each."""
    out = []
    while a < b:
        k = grid.index(start_v + a)
        end = min(grid.start(k + 1) - start_v, b)
        out.append((k, a, end))
        a = end
    return out


def run_tick(
    run: Run,
    share: Share,
    index: int,
    a: Decimal,
    b: Decimal,
    kind: TickKind,
    grid: Grid,
    outcome: str | None = None,
) -> Tick:
    """The tick of one share over run-relative [a, b) (b < a: a credit)."""
    accelerator_seconds = q6(share.count * b) - q6(share.count * a)
    rate = share.count * share.unit_price / HOUR
    cost = q6(rate * b) - q6(rate * a)
    slot = "close" if kind is TickKind.CLOSE else str(index)
    lo, hi = min(a, b), max(a, b)
    return Tick(
        tick_id=f"{run.run_id}/{slot}/{share.price_tier}",
        kind=kind,
        run_id=run.run_id,
        job_id=run.job_id,
        attempt=run.attempt,
        tenant=run.tenant,
        project=run.project,
        user=run.user,
        cluster=run.cluster,
        accelerator_type=run.accelerator_type,
        price_tier=share.price_tier,
        count=share.count,
        interval_index=index,
        interval_start=grid.wall(run.start_v + lo),
        interval_end=grid.wall(run.start_v + hi),
        start_offset_s=a,
        end_offset_s=b,
        seconds=b - a,
        accelerator_seconds=accelerator_seconds,
        unit_price=share.unit_price,
        cost=cost,
        outcome=outcome,
    )


def bill_through(run: Run, last_index: int, grid: Grid) -> tuple[Run, list[Tick]]:
    """Interval ticks for an open run up to the end of interval `last_index`."""
    until = grid.start(last_index + 1) - run.start_v
    if until <= run.billed_s:
        return run, []
    ticks = [
        run_tick(run, share, k, a, b, TickKind.INTERVAL, grid)
        for k, a, b in spans(run.start_v, run.billed_s, until, grid)
        for share in run.shares
    ]
    return replace(run, billed_s=until), ticks


def close_run(run: Run, ran_s: Decimal, grid: Grid, outcome: str | None) -> list[Tick]:
    """The remaining ticks of a run that ran `ran_s` fleet seconds, the last one a close tick.

    The meter bills an open run by the clock and learns of its end only when the end event
    arrives; if it ended inside time already billed, the close tick is a credit (negative
    seconds) for the difference, so the run's total is still exactly ran_s.
    """
    end = max(ran_s, ZERO)
    if end < run.billed_s:
        k = grid.index(run.start_v + end)
        return [
            run_tick(run, s, k, run.billed_s, end, TickKind.CLOSE, grid, outcome)
            for s in run.shares
        ]
    parts = spans(run.start_v, run.billed_s, end, grid)
    if not parts:  # ended exactly where billing stood: a zero-length close marks the end
        parts = [(grid.index(run.start_v + end), end, end)]
    *middle, (k, a, b) = parts
    ticks = [
        run_tick(run, s, i, x, y, TickKind.INTERVAL, grid) for i, x, y in middle for s in run.shares
    ]
    ticks += [run_tick(run, s, k, a, b, TickKind.CLOSE, grid, outcome) for s in run.shares]
    return ticks
