"""The SLO file (examples/slo.yaml, QM_SLO_FILE): service level objectives over the metrics
of docs/metrics.md, and the multiwindow, multi-burn-rate alert levels that watch them.

Pure: a parsed YAML document in, frozen dataclasses out, or an SloFileError naming the key.
docs/slo.md describes the format.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from schemas.health import Severity

DURATION = re.compile(r"^(\d+)(s|m|h|d|w)$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
LEVEL = re.compile(r"^[a-z][a-z0-9_]{0,30}$")
METRIC = re.compile(r"^qm_[a-z0-9_]+$")
LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Label values end up inside PromQL strings: nothing that would need escaping.
VALUE = re.compile(r'^[^"\\\n]{0,200}$')
SERVICE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
DEFAULT_DASHBOARD = "/ui/scheduler"


class SloFileError(ValueError):
    """The file cannot be used; the message names the key and what is wrong with it."""


class SliKind(StrEnum):
    # Share of a histogram's observations at or under a threshold (good = bucket le=threshold).
    LATENCY = "latency"
    # Share of events that are not bad: bad = the series with the `bad` labels too.
    ERRORS = "errors"


@dataclass(frozen=True)
class WindowPair:
    """Fires when the burn rate over both windows is above `burn_rate`."""

    long_s: int
    short_s: int
    burn_rate: float


@dataclass(frozen=True)
class AlertLevel:
    name: str  # page, ticket, ...: the alert's cause is slo_burn_<name>
    severity: Severity
    pairs: tuple[WindowPair, ...]


@dataclass(frozen=True)
class Sli:
    kind: SliKind
    metric: str  # a histogram's name, or a counter's (ending in _total)
    labels: tuple[tuple[str, str], ...] = ()
    threshold_s: float | None = None  # latency: good at or under this (a bucket bound)
    bad: tuple[tuple[str, str], ...] = ()  # errors: what marks an event bad

    @property
    def is_counter(self) -> bool:
        return self.metric.endswith("_total")

    @property
    def count_series(self) -> str:
        """The series that counts every event."""
        return self.metric if self.is_counter else f"{self.metric}_count"


@dataclass(frozen=True)
class Slo:
    name: str
    description: str
    objective: float  # share of good events, 0 < objective < 1
    period_s: int  # the error budget's window
    sli: Sli
    services: tuple[str, ...]  # scrape targets (Prometheus jobs) to read; empty = every one
    levels: tuple[AlertLevel, ...]
    action: str  # what to look at first, for the alert's suggested action

    @property
    def error_budget(self) -> float:
        return 1.0 - self.objective

    @property
    def windows_s(self) -> tuple[int, ...]:
        """Every window an alert level looks at, shortest first."""
        return tuple(
            sorted({w for lv in self.levels for p in lv.pairs for w in (p.long_s, p.short_s)})
        )

    @property
    def longest_s(self) -> int:
        return max(self.windows_s)


@dataclass(frozen=True)
class SloFile:
    slos: tuple[Slo, ...]
    dashboard: str = DEFAULT_DASHBOARD


def format_duration(seconds: int) -> str:
    """Whole seconds in the largest unit that divides them (Prometheus duration syntax)."""
    for unit in ("w", "d", "h", "m"):
        if seconds % UNIT_S[unit] == 0:
            return f"{seconds // UNIT_S[unit]}{unit}"
    return f"{seconds}s"


def parse_slo_file(doc: Mapping[str, Any]) -> SloFile:
    if not isinstance(doc, Mapping):
        raise SloFileError("expected a mapping at the top level")
    _only(doc, "", {"dashboard", "alerts", "slos"})
    dashboard = doc.get("dashboard", DEFAULT_DASHBOARD)
    if not isinstance(dashboard, str) or not dashboard.strip():
        raise SloFileError(f"dashboard: must be a text (a URL or path), got {dashboard!r}")
    default_levels = _levels(doc["alerts"], "alerts") if "alerts" in doc else None
    raw = doc.get("slos")
    if not isinstance(raw, list) or not raw:
        raise SloFileError("slos: must be a non-empty list")
    slos = tuple(_slo(item, f"slos[{i}]", default_levels) for i, item in enumerate(raw))
    names = [s.name for s in slos]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SloFileError(f"slos: names must be unique, repeated: {twice}")
    return SloFile(slos, dashboard.strip())


def _slo(item: Any, where: str, default_levels: tuple[AlertLevel, ...] | None) -> Slo:
    if not isinstance(item, Mapping):
        raise SloFileError(f"{where}: must be a mapping, got {item!r}")
    _only(item, where, {"name", "description", "objective", "period", "sli", "services", "alerts",
                        "action"})  # fmt: skip
    name = item.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise SloFileError(f"{where}.name: need lower-case letters, digits and '-', got {name!r}")
    where = f"slos.{name}"
    objective = _number(item.get("objective"), f"{where}.objective")
    if not 0.0 < objective < 1.0:
        raise SloFileError(
            f"{where}.objective: must be between 0 and 1 (exclusive), got {objective}"
        )
    period_s = _duration(item.get("period", "28d"), f"{where}.period")
    if "alerts" in item:
        levels = _levels(item["alerts"], f"{where}.alerts")
    elif default_levels is not None:
        levels = default_levels
    else:
        raise SloFileError(f"{where}: no alert levels (top-level `alerts:` or its own)")
    max_burn = 1.0 / (1.0 - objective)
    for level in levels:
        for pair in level.pairs:
            if pair.long_s > period_s:
                raise SloFileError(
                    f"{where}: alert window {format_duration(pair.long_s)} of level "
                    f"{level.name} is longer than the period {format_duration(period_s)}"
                )
            if pair.burn_rate >= max_burn:
                raise SloFileError(
                    f"{where}: burn rate {pair.burn_rate:g} of level {level.name} can never be "
                    f"exceeded: with objective {objective:g} the highest burn rate is "
                    f"{max_burn:.4g} (every event bad)"
                )
    services = item.get("services", [])
    if not isinstance(services, list) or not all(
        isinstance(s, str) and SERVICE.match(s) for s in services
    ):
        raise SloFileError(f"{where}.services: must be a list of service names, got {services!r}")
    return Slo(
        name=name,
        description=_text(item.get("description", ""), f"{where}.description"),
        objective=objective,
        period_s=period_s,
        sli=_sli(item.get("sli"), f"{where}.sli"),
        services=tuple(services),
        levels=levels,
        action=_text(item.get("action", ""), f"{where}.action"),
    )


def _sli(raw: Any, where: str) -> Sli:
    if not isinstance(raw, Mapping):
        raise SloFileError(f"{where}: must be a mapping, got {raw!r}")
    kind_raw = raw.get("kind")
    try:
        kind = SliKind(kind_raw)
    except ValueError:
        raise SloFileError(
            f"{where}.kind: one of {[k.value for k in SliKind]}, got {kind_raw!r}"
        ) from None
    metric = raw.get("metric")
    if not isinstance(metric, str) or not METRIC.match(metric):
        raise SloFileError(f"{where}.metric: a Quartermaster metric name (qm_...), got {metric!r}")
    for suffix in ("_bucket", "_count", "_sum", "_created"):
        if metric.endswith(suffix):
            raise SloFileError(f"{where}.metric: name the histogram, not its {suffix} series")
    labels = _labels(raw.get("labels", {}), f"{where}.labels")
    if kind is SliKind.LATENCY:
        _only(raw, where, {"kind", "metric", "labels", "threshold_s"})
        if metric.endswith("_total"):
            raise SloFileError(f"{where}.metric: a latency SLI needs a histogram, got {metric}")
        threshold = _number(raw.get("threshold_s"), f"{where}.threshold_s")
        if threshold <= 0:
            raise SloFileError(f"{where}.threshold_s: must be above 0, got {threshold}")
        return Sli(kind, metric, labels, threshold_s=threshold)
    _only(raw, where, {"kind", "metric", "labels", "bad"})
    bad = _labels(raw.get("bad"), f"{where}.bad")
    if not bad:
        raise SloFileError(f"{where}.bad: the labels that mark an event bad, e.g. status_class")
    overlap = sorted({k for k, _ in bad} & {k for k, _ in labels})
    if overlap:
        raise SloFileError(f"{where}: labels {overlap} are both in labels and bad")
    return Sli(kind, metric, labels, bad=bad)


def _levels(raw: Any, where: str) -> tuple[AlertLevel, ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise SloFileError(f"{where}: must be a mapping of alert levels (page, ticket, ...)")
    out = []
    for name, body in raw.items():
        if not isinstance(name, str) or not LEVEL.match(name):
            raise SloFileError(f"{where}: level names are lower-case words, got {name!r}")
        at = f"{where}.{name}"
        if not isinstance(body, Mapping):
            raise SloFileError(f"{at}: must be a mapping, got {body!r}")
        _only(body, at, {"severity", "windows"})
        try:
            severity = Severity(body.get("severity"))
        except ValueError:
            raise SloFileError(
                f"{at}.severity: one of {[s.value for s in Severity]}, got {body.get('severity')!r}"
            ) from None
        windows = body.get("windows")
        if not isinstance(windows, list) or not windows:
            raise SloFileError(
                f"{at}.windows: must be a non-empty list of {{long, short, burn_rate}}"
            )
        pairs = tuple(_pair(w, f"{at}.windows[{i}]") for i, w in enumerate(windows))
        for before, after in itertools.pairwise(pairs):
            if after.long_s <= before.long_s or after.burn_rate > before.burn_rate:
                raise SloFileError(
                    f"{at}.windows: out of order: list them by long window, shortest first, "
                    "each with a burn rate no higher than the one before"
                )
        out.append(AlertLevel(name, severity, pairs))
    return tuple(out)


def _pair(raw: Any, where: str) -> WindowPair:
    if not isinstance(raw, Mapping):
        raise SloFileError(f"{where}: must be a mapping {{long, short, burn_rate}}, got {raw!r}")
    _only(raw, where, {"long", "short", "burn_rate"})
    long_s = _duration(raw.get("long"), f"{where}.long")
    short_s = _duration(raw.get("short"), f"{where}.short")
    if short_s >= long_s:
        raise SloFileError(
            f"{where}: the short window ({format_duration(short_s)}) must be shorter than the "
            f"long one ({format_duration(long_s)})"
        )
    burn = _number(raw.get("burn_rate"), f"{where}.burn_rate")
    if burn <= 0:
        raise SloFileError(f"{where}.burn_rate: must be above 0, got {burn}")
    return WindowPair(long_s, short_s, burn)


def _labels(raw: Any, where: str) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise SloFileError(f"{where}: must be a mapping of label to value, got {raw!r}")
    out = []
    for key, value in raw.items():
        if not isinstance(key, str) or not LABEL.match(key) or key == "le":
            raise SloFileError(f"{where}: {key!r} is not a label name one may filter on")
        if not isinstance(value, str) or not VALUE.match(value):
            raise SloFileError(
                f"{where}.{key}: must be a text without quotes or backslashes (quote numbers "
                f"in YAML), got {value!r}"
            )
        out.append((key, value))
    return tuple(sorted(out))


def _duration(raw: Any, where: str) -> int:
    if isinstance(raw, str):
        match = DURATION.match(raw.strip())
        if match and int(match[1]) > 0:
            return int(match[1]) * UNIT_S[match[2]]
    raise SloFileError(
        f"{where}: a duration in whole units above zero (30s, 5m, 1h, 3d, 4w), got {raw!r}"
    )


def _number(raw: Any, where: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise SloFileError(f"{where}: must be a number, got {raw!r}")
    value = float(raw)
    if not math.isfinite(value):
        raise SloFileError(f"{where}: must be a finite number, got {raw!r}")
    return value


def _text(raw: Any, where: str) -> str:
    if not isinstance(raw, str):
        raise SloFileError(f"{where}: must be a text, got {raw!r}")
    return raw.strip()


def _only(doc: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    unknown = sorted(str(k) for k in doc if k not in allowed)
    if unknown:
        raise SloFileError(f"{where or 'top level'}: unknown key(s) {unknown}")


def catalogue_problems(slos: SloFile, catalogue: Mapping[str, Any]) -> list[str]:
    """What in the file names metrics or labels the catalogue does not have, or a metric of a
    type its SLI cannot use. `catalogue` maps names to entries with `.type` and `.labels`
    (services.common.catalogue)."""
    out = []
    for slo in slos.slos:
        sli = slo.sli
        entry = catalogue.get(sli.metric)
        if entry is None:
            out.append(f"slos.{slo.name}.sli.metric: {sli.metric} is not in docs/metrics.md")
            continue
        wanted = ("histogram",) if sli.kind is SliKind.LATENCY else ("histogram", "counter")
        if entry.type not in wanted:
            out.append(
                f"slos.{slo.name}.sli.metric: {sli.metric} is a {entry.type}; {sli.kind} "
                f"SLIs need a {' or '.join(wanted)}"
            )
        for key, _ in (*sli.labels, *sli.bad):
            if key not in entry.labels:
                out.append(
                    f"slos.{slo.name}.sli: {sli.metric} has no label {key!r} "
                    f"(it has {sorted(entry.labels)})"
                )
    return out
