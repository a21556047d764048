"""The tick math: cutting a run into usage ticks on the metering grid, and pricing them. Pure.

Time is fleet time (virtual seconds on the simulated fleet): a wall-clock instant t maps to
`t x time_scale` seconds since the epoch, and the grid cuts that line every `interval`
seconds, so every run's ticks fall in the same intervals. A run occupies
[start_v, start_v + ran); its ticks are that span cut at the grid's edges.

Amounts are integers in millionths of their unit (names end in `_u`: microseconds,
micro-accelerators, millionths of a currency unit): exact, and fast enough for tens of
thousands of ticks a second. A tick's accelerator-seconds and cost are the difference of the
run's *cumulative* amounts (rounded to a millionth) at its two ends, so however a run is cut,
its ticks add up exactly to count x ran and to the cost of that, rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction
from typing import NamedTuple

from schemas.usage import TickKind
from services.common.frozen import evolve

MICRO = 1_000_000
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
# cost_u = count_u x price_u x seconds_u / _COST: millionths of an accelerator, of a price per
# hour and of a second make millionths of a currency unit after dividing by 3600 x 10^12.
_COST = 3600 * MICRO * MICRO


def micros(value: float | int | str | Decimal) -> int:
    """Millionths of `value`, exactly as written (0.1 is 100000, not its binary neighbour)."""
    return int((Decimal(str(value)) * MICRO).to_integral_value(ROUND_HALF_EVEN))


def rdiv(n: int, d: int) -> int:
    """n / d rounded half away from zero (d > 0): the same rule for credits and charges."""
    q = (abs(n) + d // 2) // d
    return q if n >= 0 else -q


def decimal(value_u: int) -> Decimal:
    return Decimal(value_u).scaleb(-6)


@dataclass(frozen=True)
class Grid:
    """The metering grid: `interval_u` fleet microseconds per interval; `scale` fleet seconds
    per wall-clock second, as the fraction num / den."""

    interval_u: int
    num: int
    den: int
    # Interval edges recur in every run's ticks: their wall-clock times are worth keeping.
    _walls: dict[int, datetime] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, interval_s: float | str | Decimal, time_scale: float | str | Decimal) -> Grid:
        scale = Fraction(str(time_scale))
        grid = cls(micros(interval_s), scale.numerator, scale.denominator)
        if grid.interval_u <= 0 or scale <= 0:
            raise ValueError("interval and time scale must be positive")
        return grid

    @property
    def interval_s(self) -> float:
        return self.interval_u / MICRO

    def virtual(self, wall: datetime) -> int:
        return rdiv(((wall - EPOCH) // _US) * self.num, self.den)

    def wall(self, virtual_u: int) -> datetime:
        at = self._walls.get(virtual_u)
        if at is None:
            if len(self._walls) > 100_000:
                self._walls.clear()
            at = EPOCH + timedelta(microseconds=rdiv(virtual_u * self.den, self.num))
            self._walls[virtual_u] = at
        return at

    def index(self, virtual_u: int) -> int:
        return virtual_u // self.interval_u

    def start(self, index: int) -> int:
        return index * self.interval_u

    def closed_through(self, now: datetime) -> int:
        """The last interval that has ended by wall-clock `now`."""
        return self.index(self.virtual(now)) - 1


@dataclass(frozen=True)
class Share:
    """The part of an allocation on nodes of one price tier."""

    price_tier: str
    count_u: int  # accelerators (a fraction for a shared device)
    unit_price_u: int  # per accelerator-hour


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
    start_v: int  # fleet time it started, microseconds since the epoch
    billed_u: int = 0  # fleet microseconds since its start already billed

    @property
    def run_id(self) -> str:
        return f"{self.job_id}#{self.attempt}"


class Tick(NamedTuple):
    """One tick, as the ledger stores it (a tuple: tens of thousands are made a second)."""

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
    count_u: int
    interval_index: int
    interval_start: datetime
    interval_end: datetime
    start_offset_u: int
    end_offset_u: int
    seconds_u: int
    accelerator_seconds_u: int
    unit_price_u: int
    cost_u: int
    outcome: str | None = None


def spans(start_v: int, a: int, b: int, grid: Grid) -> list[tuple[int, int, int]]:
    """Run-relative [a, b) cut at the grid's edges: (interval index, from, to) each."""
    out = []
    while a < b:
        k = (start_v + a) // grid.interval_u
        end = min((k + 1) * grid.interval_u - start_v, b)
        out.append((k, a, end))
        a = end
    return out


def run_ticks(
    run: Run,
    share: Share,
    parts: list[tuple[int, int, int]],
    kind: TickKind,
    grid: Grid,
    outcome: str | None = None,
) -> list[Tick]:
    """The ticks of one share over consecutive run-relative spans (index, from, to); a span
    with to < from is a credit. Each tick's amounts are differences of the cumulative ones."""
    count, price = share.count_u, share.unit_price_u
    rate = count * price
    out = []
    a0 = parts[0][1] if parts else 0
    acc_before, cost_before = rdiv(count * a0, MICRO), rdiv(rate * a0, _COST)
    for k, a, b in parts:
        acc, cost = rdiv(count * b, MICRO), rdiv(rate * b, _COST)
        if a != a0:  # not contiguous with the previous span: start from its own beginning
            acc_before, cost_before = rdiv(count * a, MICRO), rdiv(rate * a, _COST)
        lo, hi = (a, b) if a <= b else (b, a)
        slot = "close" if kind is TickKind.CLOSE else k
        out.append(
            Tick(
                f"{run.run_id}/{slot}/{share.price_tier}",
                kind,
                run.run_id,
                run.job_id,
                run.attempt,
                run.tenant,
                run.project,
                run.user,
                run.cluster,
                run.accelerator_type,
                share.price_tier,
                count,
                k,
                grid.wall(run.start_v + lo),
                grid.wall(run.start_v + hi),
                a,
                b,
                b - a,
                acc - acc_before,
                price,
                cost - cost_before,
                outcome,
            )
        )
        acc_before, cost_before, a0 = acc, cost, b
    return out


def bill_through(run: Run, last_index: int, grid: Grid) -> tuple[Run, list[Tick]]:
    """Interval ticks for an open run up to the end of interval `last_index`."""
    until = grid.start(last_index + 1) - run.start_v
    if until <= run.billed_u:
        return run, []
    parts = spans(run.start_v, run.billed_u, until, grid)
    ticks = [t for s in run.shares for t in run_ticks(run, s, parts, TickKind.INTERVAL, grid)]
    return evolve(run, billed_u=until), ticks


def close_run(run: Run, ran_u: int, grid: Grid, outcome: str | None) -> list[Tick]:
    """The remaining ticks of a run that ran `ran_u` fleet microseconds, the last a close tick.

    The meter bills an open run by the clock and learns of its end only when the end event
    arrives; if it ended inside time already billed, the close tick is a credit (negative
    seconds) for the difference, so the run's total is still exactly what it ran.
    """
    end = max(ran_u, 0)
    if end < run.billed_u:
        credit = [(grid.index(run.start_v + end), run.billed_u, end)]
        return [
            t for s in run.shares for t in run_ticks(run, s, credit, TickKind.CLOSE, grid, outcome)
        ]
    parts = spans(run.start_v, run.billed_u, end, grid)
    if not parts:  # ended exactly where billing stood: a zero-length close marks the end
        parts = [(grid.index(run.start_v + end), end, end)]
    ticks = []
    for s in run.shares:
        ticks += run_ticks(run, s, parts[:-1], TickKind.INTERVAL, grid)
        ticks += run_ticks(run, s, parts[-1:], TickKind.CLOSE, grid, outcome)
    return ticks
