"""Multiwindow, multi-burn-rate evaluation of the SLO file over scraped counters.

Pure: samples and times in, verdicts and breach decisions out. The shell
(services.health.slowatch) scrapes, feeds each SLO's Tally, and writes what `decide` returns.

- A reading is one target's cumulative (good, total) events for an SLO, since that process
  started. Tally turns the readings into one series that only grows: per target it adds the
  increase since the last reading, and a reading below the last one is a restarted process
  (its counters began again at zero), whose whole reading is the increase.
- The burn rate over a window is the error ratio of the events in it over the error budget
  (1 - objective): 1 spends the budget exactly over the period, 14.4 spends 2% of a 30-day
  budget in an hour.
- A level fires when, for one of its window pairs, both the long and the short window burn
  above the pair's rate; a pair is judged only once the history covers its long window. A
  breach opens (one alert) when its level fires and closes when every pair of the level was
  judged and none fires.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime

from schemas.health import Severity
from services.common.scrape import Sample
from services.health.slofile import AlertLevel, Sli, SliKind, Slo, SloFile, format_duration

# A counter past 2**53 has lost integer precision (a float64 cannot count one more event):
# no real process gets there, so such a sample is hostile or broken and is left out.
MAX_SAMPLE = 2.0**53
BIGINT_MAX = 2**63 - 1  # health.slo_breaches.count is a bigint
# Points per SLO: the longest window over the evaluation interval, never more than this
# (3 days at 2.6 s; ~100 bytes a point, so ~10 MB per SLO at the limit).
POINTS_LIMIT = 100_000
MAX_POINTS = 20_000  # the default cap of a Tally built without one (3 days at 15 s: 17,280)


class NoBucket(ValueError):
    """A latency SLI's threshold is not a bucket bound of its histogram."""


class CannotCover(ValueError):
    """The evaluation interval is too short for the longest window to fit in POINTS_LIMIT."""


def points_for(longest_s: float, every_s: float) -> int:
    """The points a tally needs to span `longest_s` with one point every `every_s` (or more):
    one per round, the baseline at or before the window's start, and one spare."""
    if every_s <= 0:
        raise CannotCover(f"the evaluation interval must be above 0 s, got {every_s:g}")
    return math.ceil(longest_s / every_s) + 2


def max_points(slos: SloFile, every_s: float) -> dict[str, int]:
    """Each SLO's point cap for rounds every `every_s`; CannotCover (naming the SLO, the window
    and the shortest interval that would do) when one would need more than POINTS_LIMIT."""
    out = {}
    for slo in slos.slos:
        need = points_for(slo.longest_s, every_s)
        if need > POINTS_LIMIT:
            shortest = slo.longest_s / (POINTS_LIMIT - 2)
            raise CannotCover(
                f"QM_SLO_EVAL_EVERY_S={every_s:g}: SLO {slo.name}'s "
                f"{format_duration(slo.longest_s)} window would need {need} points, more than "
                f"{POINTS_LIMIT}; evaluate every {math.ceil(shortest * 10) / 10:g} s or more"
            )
        out[slo.name] = need
    return out


def clamp_count(value: float) -> int:
    """An event count as the store's bigint can hold it (0 for NaN)."""
    if math.isnan(value) or value <= 0:
        return 0
    if value >= BIGINT_MAX:
        return BIGINT_MAX
    return min(round(value), BIGINT_MAX)


@dataclass(frozen=True)
class Reading:
    good: float
    total: float


def _matches(sample: Sample, labels: Iterable[tuple[str, str]]) -> bool:
    return all(sample.labels.get(k) == v for k, v in labels)


def reading_of(sli: Sli, samples: Iterable[Sample]) -> Reading:
    """One target's cumulative good and total events for `sli` (0, 0 when it serves none)."""
    good = total = bad = 0.0
    buckets_seen = threshold_seen = False
    count_name = sli.count_series
    bucket_name = f"{sli.metric}_bucket"
    bad_labels = (*sli.labels, *sli.bad)
    for s in samples:
        if not math.isfinite(s.value) or s.value < 0 or s.value > MAX_SAMPLE:
            continue
        if s.name == count_name and _matches(s, sli.labels):
            total += s.value
            if sli.kind is SliKind.ERRORS and _matches(s, bad_labels):
                bad += s.value
        elif sli.kind is SliKind.LATENCY and s.name == bucket_name and _matches(s, sli.labels):
            buckets_seen = True
            try:
                le = float(s.labels.get("le", "nan"))
            except ValueError:
                continue
            if le == sli.threshold_s:
                threshold_seen = True
                good += s.value
    if sli.kind is SliKind.ERRORS:
        return Reading(total - bad, total)
    if buckets_seen and not threshold_seen:
        raise NoBucket(f"{sli.metric} has no bucket at le={sli.threshold_s:g}")
    return Reading(min(good, total), total)


@dataclass(frozen=True, slots=True)
class Point:
    at: float  # seconds (the evaluator's monotonic clock)
    good: float  # events since the tally began, resets accounted for
    total: float


@dataclass
class Tally:
    """One SLO's event counts over time, bounded to what its longest window needs."""

    keep_s: float
    max_points: int = MAX_POINTS
    last: dict[str, Reading] = field(default_factory=dict)
    points: deque[Point] = field(default_factory=deque)

    def add(self, at: float, readings: Mapping[str, Reading]) -> None:
        """Readings of the targets that answered at `at`; none answering adds no point (a
        gap is not a quiet spell)."""
        if not readings:
            return
        prev = self.points[-1] if self.points else Point(at, 0.0, 0.0)
        good, total = prev.good, prev.total
        for target, now in sorted(readings.items()):
            if not (math.isfinite(now.good) and math.isfinite(now.total)):
                self.last.pop(target, None)  # unreadable: its next reading is a new baseline
                continue
            before = self.last.get(target)
            self.last[target] = now
            if before is None:
                continue  # the first reading is the baseline: its past is not in any window
            if now.total < before.total or now.good < before.good:
                before = Reading(0.0, 0.0)  # a restarted process counts from zero again
            good += now.good - before.good
            total += now.total - before.total
        if not (math.isfinite(good) and math.isfinite(total)):
            # Overflowed (inf, or inf - inf = NaN): the history cannot be trusted, so it
            # starts again from here, as after a start; nothing is judged until it spans.
            self.points.clear()
            good = total = 0.0
        self.points.append(Point(at, good, total))
        # Keep one point at or before the longest window's start: the baseline it needs.
        while len(self.points) > 1 and self.points[1].at <= at - self.keep_s:
            self.points.popleft()
        while len(self.points) > self.max_points:
            self.points.popleft()

    @property
    def span_s(self) -> float:
        return self.points[-1].at - self.points[0].at if self.points else 0.0

    def events(self, window_s: float) -> tuple[float, float] | None:
        """(bad, total) events in the window ending at the newest point; the whole history
        when it is shorter than the window; None before two points."""
        if len(self.points) < 2:
            return None
        newest = self.points[-1]
        start = newest.at - window_s
        base = self.points[0]
        for p in self.points:  # newest point at or before the window's start
            if p.at > start:
                break
            base = p
        total = newest.total - base.total
        good = newest.good - base.good
        return max(total - good, 0.0), total


def burn_rate(bad: float, total: float, objective: float) -> float:
    """The error ratio over the error budget; 0 with no events (nothing went wrong)."""
    if not total > 0 or not math.isfinite(total) or not math.isfinite(bad):
        return 0.0
    return min(max(bad / total, 0.0), 1.0) / (1.0 - objective)


@dataclass(frozen=True)
class PairVerdict:
    long_s: int
    short_s: int
    threshold: float
    long_burn: float
    short_burn: float
    bad: float  # events in the long window
    total: float

    @property
    def firing(self) -> bool:
        return self.long_burn > self.threshold and self.short_burn > self.threshold


@dataclass(frozen=True)
class LevelVerdict:
    slo: Slo
    level: AlertLevel
    pairs: tuple[PairVerdict, ...]  # the pairs judged: those whose long window is covered
    complete: bool = True  # every pair of the level was judged

    @property
    def firing(self) -> PairVerdict | None:
        """The first pair that fires, if any."""
        return next((p for p in self.pairs if p.firing), None)


def judge(slo: Slo, tally: Tally) -> tuple[LevelVerdict, ...] | None:
    """Every level's verdict over the pairs whose long window the history covers; None while
    it covers none (just after a start: too little to say anything, so nothing opens or
    closes). A pair is judged only on a whole long window: a burn rate over part of it is
    over fewer events than its threshold was chosen for, so it would raise false alerts."""
    if len(tally.points) < 2:
        return None
    span = tally.span_s
    out = []
    for level in slo.levels:
        pairs = []
        for pair in level.pairs:
            if span < pair.long_s:
                continue
            long_events = tally.events(pair.long_s)
            short_events = tally.events(pair.short_s)
            assert long_events is not None and short_events is not None
            pairs.append(
                PairVerdict(
                    pair.long_s,
                    pair.short_s,
                    pair.burn_rate,
                    burn_rate(*long_events, slo.objective),
                    burn_rate(*short_events, slo.objective),
                    *long_events,
                )
            )
        out.append(LevelVerdict(slo, level, tuple(pairs), len(pairs) == len(level.pairs)))
    if not any(v.pairs for v in out):
        return None
    return tuple(out)


@dataclass(frozen=True)
class Breach:
    """A level of an SLO firing, from its alert until it stops: one alert.raised each."""

    breach_id: str  # the alert's id
    slo: str
    level: str
    severity: Severity
    suggested_action: str
    opened_at: datetime
    count: int  # bad events in the long window when it opened
    closed_at: datetime | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.slo, self.level)

    @property
    def subject(self) -> str:
        return f"slo/{self.slo}"

    @property
    def cause(self) -> str:
        return f"slo_burn_{self.level}"


@dataclass(frozen=True)
class Decisions:
    opened: tuple[Breach, ...] = ()
    closed: tuple[Breach, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.opened or self.closed)


def suggested_action(verdict: LevelVerdict, pair: PairVerdict, dashboard: str) -> str:
    slo = verdict.slo
    about = f" ({slo.description})" if slo.description else ""
    long_w, short_w = format_duration(pair.long_s), format_duration(pair.short_s)
    text = (
        f"SLO {slo.name}{about} is burning its error budget {pair.long_burn:.1f}x over "
        f"{long_w} and {pair.short_burn:.1f}x over {short_w} (alert above {pair.threshold:g}x; "
        f"{pair.bad:.0f} of {pair.total:.0f} events bad over {long_w}, objective "
        f"{slo.objective:.4g})."
    )
    if slo.action:
        text += f" {slo.action}"
    return f"{text} See {dashboard} and the Grafana dashboard 'Quartermaster SLOs'."


def decide(
    slos: SloFile,
    verdicts: Mapping[str, tuple[LevelVerdict, ...] | None],
    open_breaches: Mapping[tuple[str, str], Breach],
    now: datetime,
    new_id: Callable[[], str],
) -> Decisions:
    """Open a breach for each level that fires (one of its judged pairs) without one; close
    each open breach whose level had every pair judged and none firing, or that the file no
    longer has. An SLO or level not (wholly) judged this time keeps its breaches as they are."""
    opened, closed = [], []
    levels = {(s.name, lv.name) for s in slos.slos for lv in s.levels}
    for key, breach in sorted(open_breaches.items()):
        if key not in levels:
            closed.append(replace(breach, closed_at=now))
    for slo in slos.slos:
        judged = verdicts.get(slo.name)
        if judged is None:
            continue
        for verdict in judged:
            key = (slo.name, verdict.level.name)
            pair = verdict.firing
            if pair is not None and key not in open_breaches:
                opened.append(
                    Breach(
                        breach_id=new_id(),
                        slo=slo.name,
                        level=verdict.level.name,
                        severity=verdict.level.severity,
                        suggested_action=suggested_action(verdict, pair, slos.dashboard),
                        opened_at=now,
                        count=clamp_count(pair.bad),
                    )
                )
            elif pair is None and verdict.complete and key in open_breaches:
                closed.append(replace(open_breaches[key], closed_at=now))
    return Decisions(tuple(opened), tuple(closed))
