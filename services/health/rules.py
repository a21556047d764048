"""The health rules (examples/health.yaml) as frozen dataclasses: which signal quarantines a
node at once, which only after n signals within a window, and the silence and recovery timings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from schemas.health import Severity, SignalKind

HEARTBEAT_LOST = "heartbeat_lost"


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
class HealthRules:
    rules: tuple[Rule, ...]
    timings: Timings
    silence_severity: Severity = Severity.CRITICAL
    silence_action: str = "Check the node's network and its agent; drain it if it stays dark."
    cluster_silence_action: str = (
        "The whole cluster stopped reporting: check its executor and its link; "
        "jobs there are being requeued elsewhere."
    )

    def match(self, kind: SignalKind, xid: int | None) -> Rule | None:
        return next((r for r in self.rules if r.matches(kind, xid)), None)

    def by_name(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)

    def clean_period_for(self, cause: str | None) -> float:
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
        if len(set(names)) != len(names) or HEARTBEAT_LOST in names:
            raise ValueError(f"rules: names must be unique and not {HEARTBEAT_LOST!r}")
        silence = doc.get("silence") or {}
        return cls(
            rules,
            timings,
            Severity(silence.get("severity", Severity.CRITICAL)),
            silence.get("suggested_action", cls.silence_action),
            silence.get("cluster_suggested_action", cls.cluster_silence_action),
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
