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
  above the pair's rate; a breach opens (one alert) when its level fires and closes when it
  no longer does.
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

MAX_POINTS = 20_000  # per SLO: 3 days at one point every 15 s is 17,280


class NoBucket(ValueError):
    """A latency SLI's threshold is not a bucket bound of its histogram."""


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
        if not math.isfinite(s.value) or s.value < 0:
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


@dataclass(frozen=True)
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
            before = self.last.get(target)
            self.last[target] = now
            if before is None:
                continue  # the first reading is the baseline: its past is not in any window
            if now.total < before.total or now.good < before.good:
                before = Reading(0.0, 0.0)  # a restarted process counts from zero again
            good += now.good - before.good
            total += now.total - before.total
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
    if total <= 0:
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
    pairs: tuple[PairVerdict, ...]

    @property
    def firing(self) -> PairVerdict | None:
        """The first pair that fires, if any."""
        return next((p for p in self.pairs if p.firing), None)


def judge(slo: Slo, tally: Tally) -> tuple[LevelVerdict, ...] | None:
    """Every level's verdict, or None while the history is shorter than the shortest window
    (just after a start: too little to say anything, so nothing opens or closes)."""
    if len(tally.points) < 2 or tally.span_s < min(slo.windows_s):
        return None
    out = []
    for level in slo.levels:
        pairs = []
        for pair in level.pairs:
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
        out.append(LevelVerdict(slo, level, tuple(pairs)))
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
    """Open a breach for each level that fires without one; close each open breach whose
    level was judged and no longer fires, or that the file no longer has. An SLO not judged
    this time (no verdicts) keeps its breaches as they are."""
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
                        count=round(pair.bad),
                    )
                )
            elif pair is None and key in open_breaches:
                closed.append(replace(open_breaches[key], closed_at=now))
    return Decisions(tuple(opened), tuple(closed))
