"""One node's health state machine, as pure functions over a frozen `NodeHealth`.

    healthy --(missed heartbeats: suspect_after_s)--> suspect --(heartbeat)--> healthy
    healthy|suspect --(critical signal | n-of-window transient signals
                       | silence for unhealthy_after_s)--> unhealthy
    unhealthy --(min quarantine served, clean period without a bad signal,
                 heartbeats fresh)--> healthy

Hysteresis lives in the last edge: a node that keeps flapping keeps pushing its clean period
back, so it is quarantined once and stays out instead of bouncing in and out of scheduling.
Nothing here reads a clock or logs; `now` is always passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from services.common.frozen import evolve
from services.health.rules import HEARTBEAT_LOST, HealthRules, Rule, Timings


class NodeState(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"  # heartbeats late; still schedulable, nobody is told yet
    UNHEALTHY = "unhealthy"  # quarantined: node.unhealthy was announced


class Verdict(StrEnum):
    NONE = "none"  # nothing to announce
    QUARANTINE = "quarantine"  # the node just became unhealthy
    COUNTED = "counted"  # a bad signal on an already quarantined node


@dataclass(frozen=True)
class Signal:
    """A bad signal seen on a node, kept while it may still count towards a threshold."""

    rule: str
    at: datetime
    label: str


@dataclass(frozen=True)
class NodeHealth:
    node_id: str
    cluster: str
    state: NodeState = NodeState.HEALTHY
    # The last heartbeat, or when the node was first heard of: silence is counted from here.
    last_heard: datetime | None = None
    recent: tuple[Signal, ...] = ()  # transient signals still inside their rule's window
    incident_id: str | None = None
    cause: str | None = None
    quarantined_at: datetime | None = None
    last_bad_at: datetime | None = None  # the clean period counts from here


def seconds(later: datetime, earlier: datetime) -> float:
    return (later - earlier).total_seconds()


def heartbeat(node: NodeHealth, at: datetime, timings: Timings) -> NodeHealth:
    """A heartbeat sent at `at`. Late or repeated heartbeats change nothing."""
    prev = node.last_heard
    if prev is not None and at <= prev:
        return node
    if node.state == NodeState.SUSPECT:
        return evolve(node, last_heard=at, state=NodeState.HEALTHY)
    node = evolve(node, last_heard=at)  # most heartbeats: a cheaper copy than replace
    if node.state == NodeState.UNHEALTHY and (
        prev is None or seconds(at, prev) >= timings.suspect_after_s
    ):
        # A gap while quarantined counts as bad: after silence the clean period starts only
        # once the node speaks again, not when it first went dark.
        node = replace(node, last_bad_at=_latest(node.last_bad_at, at))
    return node


def probe(
    node: NodeHealth, rule: Rule, signal: Signal, now: datetime
) -> tuple[NodeHealth, Verdict, tuple[Signal, ...]]:
    """A bad signal matched by `rule`; returns the node, the verdict and the signals behind it."""
    if node.state == NodeState.UNHEALTHY:
        return (
            replace(node, last_bad_at=_latest(node.last_bad_at, signal.at)),
            Verdict.COUNTED,
            (signal,),
        )
    # Only this rule's signals within its window (by the probes' own times) count together.
    kept = tuple(
        s
        for s in (*node.recent, signal)
        if s.rule != rule.name or seconds(signal.at, s.at) < rule.window_s
    )
    mine = tuple(s for s in kept if s.rule == rule.name)
    if rule.critical or len(mine) >= rule.threshold:
        sick = quarantine(node, rule.name, now, bad_at=signal.at)
        return sick, Verdict.QUARANTINE, mine if not rule.critical else (signal,)
    return replace(node, recent=kept), Verdict.NONE, ()


def silence(
    node: NodeHealth, now: datetime, watch_from: datetime, timings: Timings
) -> tuple[NodeHealth, Verdict]:
    """Judge heartbeat age. `watch_from` (service start) keeps a restarted health service
    from declaring the fleet dead before it has caught up with the heartbeat topic."""
    if node.state == NodeState.UNHEALTHY:
        return node, Verdict.NONE
    age = silent_for(node, now, watch_from)
    if age >= timings.unhealthy_after_s:
        return quarantine(node, HEARTBEAT_LOST, now, bad_at=now), Verdict.QUARANTINE
    if age >= timings.suspect_after_s and node.state == NodeState.HEALTHY:
        return replace(node, state=NodeState.SUSPECT), Verdict.NONE
    return node, Verdict.NONE


def silent_for(node: NodeHealth, now: datetime, watch_from: datetime) -> float:
    heard = watch_from if node.last_heard is None else max(node.last_heard, watch_from)
    return seconds(now, heard)


def quarantine(node: NodeHealth, cause: str, now: datetime, *, bad_at: datetime) -> NodeHealth:
    return replace(
        node,
        state=NodeState.UNHEALTHY,
        cause=cause,
        quarantined_at=now,
        last_bad_at=bad_at,
        recent=(),
    )


def recoverable(node: NodeHealth, now: datetime, rules: HealthRules) -> bool:
    """Quarantine served, clean period passed, and the node is reporting again."""
    if node.state != NodeState.UNHEALTHY or node.quarantined_at is None:
        return False
    t = rules.timings
    if node.last_heard is None or seconds(now, node.last_heard) >= t.suspect_after_s:
        return False
    if seconds(now, node.quarantined_at) < t.min_quarantine_s:
        return False
    bad = node.last_bad_at or node.quarantined_at
    return seconds(now, bad) >= rules.clean_period_for(node.cause)


def recover(node: NodeHealth) -> NodeHealth:
    return replace(
        node,
        state=NodeState.HEALTHY,
        cause=None,
        incident_id=None,
        quarantined_at=None,
        last_bad_at=None,
        recent=(),
    )


def _latest(a: datetime | None, b: datetime) -> datetime:
    return b if a is None or b > a else a
