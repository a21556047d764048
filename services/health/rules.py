"""The health rules (examples/health.yaml) as frozen dataclasses: which signal quarantines a
node at once, which only after n signals within a window, the silence and recovery timings, and
when a gang's slow replica makes its node a straggler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from schemas.health import Severity, SignalKind

HEARTBEAT_LOST = "heartbeat_lost"
STRAGGLER = "straggler"
BUILT_IN_CAUSES = (HEARTBEAT_LOST, STRAGGLER)
STRAGGLER_ACTION = (
    "Node {node} runs job {job}'s replica {replica} {ratio:.1f}x slower than its peers; "
    "drain it after the job checkpoints, and check thermal and PCIe."
)
# m verdicts are kept (and stored) per node and job: keep the window small.
MAX_WINDOW = 100


@dataclass(frozen=True)
class Rule:
    """How one kind of signal is judged. The first matching rule in file order wins, so
    specific XID rules go before a catch-all `gpu_xid` rule."""

    name: str
    kind: SignalKind
    severity: Severity
    suggested_action: str
    xids: frozenset[int] = frozenset()  # empty: any XID (or not an XID rule)
    critical: bool = False  # quarantine on the first signal
    threshold: int = 1  # otherwise: this many signals ...
    window_s: float = 0.0  # ... within this many seconds
    clean_period_s: float | None = None  # None: the timings' default

    def matches(self, kind: SignalKind, xid: int | None) -> bool:
        return kind == self.kind and (not self.xids or xid in self.xids)


@dataclass(frozen=True)
class Timings:
    suspect_after_s: float = 15.0  # three missed 5 s heartbeats
    unhealthy_after_s: float = 30.0
    min_quarantine_s: float = 300.0
    clean_period_s: float = 120.0  # no bad signal for this long before recovery
    # A cluster where every known node (at least this many) went silent is one cluster
    # incident with one alert, not a storm of node alerts.
    cluster_min_nodes: int = 2


@dataclass(frozen=True)
class StragglerRules:
    """A replica is slow in a report when its step time exceeds `slowdown` x the median of its
    gang peers'; its node is a straggler on that job once slow in `n` of the last `m` reports,
    and stops being one after `m` reports in a row that are not slow, or when the job's
    reports for it stop for `expire_after_s`."""

    slowdown: float = 1.5
    n: int = 3
    m: int = 5
    quarantine: bool = False  # also take the node out (node.unhealthy, cause straggler)
    expire_after_s: float = 60.0
    severity: Severity = Severity.WARNING
    # Placeholders: {node}, {job}, {replica}, {ratio} (a float: format it, e.g. {ratio:.1f}).
    suggested_action: str = STRAGGLER_ACTION
    clean_period_s: float | None = None  # after a straggler quarantine; None: the default

    def action_for(self, node: str, job: str, replica: int, ratio: float) -> str:
        return self.suggested_action.format(node=node, job=job, replica=replica, ratio=ratio)

    @classmethod
    def from_dict(cls, raw: Any) -> StragglerRules:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"straggler: expected a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"straggler: unknown key(s) {unknown}; known: {sorted(known)}")
        d = cls()
        try:
            severity = Severity(raw.get("severity", d.severity))
        except ValueError as exc:
            raise ValueError(f"straggler: severity: {exc}") from exc
        rules = cls(
            slowdown=_number(raw, "slowdown", d.slowdown),
            n=_count(raw, "n", d.n),
            m=_count(raw, "m", d.m),
            quarantine=_flag(raw, "quarantine", d.quarantine),
            expire_after_s=_number(raw, "expire_after_s", d.expire_after_s),
            severity=severity,
            suggested_action=str(raw.get("suggested_action", d.suggested_action)),
            clean_period_s=(
                None if raw.get("clean_period_s") is None else _number(raw, "clean_period_s", 0.0)
            ),
        )
        if rules.slowdown <= 1:
            raise ValueError(f"straggler: slowdown must be > 1, got {rules.slowdown}")
        if not 1 <= rules.n <= rules.m <= MAX_WINDOW:
            raise ValueError(
                f"straggler: need 1 <= n <= m <= {MAX_WINDOW}, got n={rules.n}, m={rules.m}"
            )
        if rules.expire_after_s <= 0:
            raise ValueError(f"straggler: expire_after_s must be > 0, got {rules.expire_after_s}")
        if rules.clean_period_s is not None and rules.clean_period_s < 0:
            raise ValueError(f"straggler: clean_period_s must be >= 0, got {rules.clean_period_s}")
        try:
            rules.action_for("node-1", "job-1", 0, 2.0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"straggler: suggested_action: bad placeholder {exc}; "
                "use {node}, {job}, {replica}, {ratio}"
            ) from exc
        return rules


@dataclass(frozen=True)
class HealthRules:
    rules: tuple[Rule, ...]
    timings: Timings
    silence_severity: Severity = Severity.CRITICAL
    silence_action: str = "Check the node's network and its agent; drain it if it stays dark."
    cluster_silence_action: str = (
        "The whole cluster stopped reporting: check its executor and its link; "
        "jobs there are being requeued elsewhere."
    )
    straggler: StragglerRules = StragglerRules()

    def match(self, kind: SignalKind, xid: int | None) -> Rule | None:
        return next((r for r in self.rules if r.matches(kind, xid)), None)

    def by_name(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)

    def clean_period_for(self, cause: str | None) -> float:
        if cause == STRAGGLER and self.straggler.clean_period_s is not None:
            return self.straggler.clean_period_s
        rule = self.by_name(cause) if cause else None
        if rule is not None and rule.clean_period_s is not None:
            return rule.clean_period_s
        return self.timings.clean_period_s

    def window_for(self, name: str) -> float:
        rule = self.by_name(name)
        return rule.window_s if rule is not None else 0.0

    def with_timings(self, **overrides: float | None) -> HealthRules:
        """These rules with some timings replaced (settings override the file in tests)."""
        given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, timings=replace(self.timings, **given))

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> HealthRules:
        timings = Timings(**{k: v for k, v in (doc.get("timings") or {}).items()})
        if not 0 < timings.suspect_after_s <= timings.unhealthy_after_s:
            raise ValueError("timings: need 0 < suspect_after_s <= unhealthy_after_s")
        rules = tuple(_rule(r) for r in doc.get("rules") or [])
        names = [r.name for r in rules]
        if len(set(names)) != len(names) or set(names) & set(BUILT_IN_CAUSES):
            raise ValueError(f"rules: names must be unique and none of {list(BUILT_IN_CAUSES)}")
        silence = doc.get("silence") or {}
        return cls(
            rules,
            timings,
            Severity(silence.get("severity", Severity.CRITICAL)),
            silence.get("suggested_action", cls.silence_action),
            silence.get("cluster_suggested_action", cls.cluster_silence_action),
            StragglerRules.from_dict(doc.get("straggler")),
        )


def _rule(raw: dict[str, Any]) -> Rule:
    try:
        rule = Rule(
            name=str(raw["name"]),
            kind=SignalKind(raw["kind"]),
            severity=Severity(raw.get("severity", Severity.WARNING)),
            suggested_action=str(raw.get("suggested_action", "Inspect the node.")),
            xids=frozenset(int(x) for x in raw.get("xids") or ()),
            critical=bool(raw.get("critical", False)),
            threshold=int(raw.get("threshold", 1)),
            window_s=float(raw.get("window_s", 0.0)),
            clean_period_s=(
                None if raw.get("clean_period_s") is None else float(raw["clean_period_s"])
            ),
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(f"rule {raw.get('name', '?')!r}: {exc}") from exc
    if not rule.critical and (rule.threshold < 1 or rule.window_s <= 0):
        raise ValueError(f"rule {rule.name!r}: a transient rule needs threshold >= 1, window_s > 0")
    return rule


def _number(raw: dict[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    # YAML `yes`/`true` parse as bool, a subclass of int: refuse it rather than read 1.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"straggler: {key} must be a number, got {value!r}")
    return float(value)


def _count(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"straggler: {key} must be a whole number, got {value!r}")
    return value


def _flag(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"straggler: {key} must be true or false, got {value!r}")
    return value
