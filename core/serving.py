"""Decisions for inference services (pure): how many replicas a service should have for the
load its replicas report, and the next step of a rolling update from one model version to the
next. The serving service (issue 13, not built yet) drives a service's replica jobs with these;
the simulator can run them on the same inputs.

Nothing here reads a clock or does I/O; `now` is passed in, in seconds.

Scaling. Each replica reports requests per second and a latency percentile. A service has a
target load per replica and a latency objective. It grows at once when the load per replica is
above the target or the latency is above the objective, to the replicas the load needs (at
least one more when only the latency is missed); it shrinks only when the load has needed fewer
replicas, by a margin, for a whole `scale_down_after_s` (so a dip does not drop replicas it
will need back a minute later), and then to what the highest load of that window needed.
Always within min and max.

Rolling update. A new version replaces the old a few replicas at a time: at most `max_surge`
replicas above the desired count and at most `max_unavailable` below it in ready replicas. An
old replica stops only when a new one is ready in its place. The update rolls back by itself
when a new replica fails, does not become ready within `ready_timeout_s`, or misses the latency
objective while the old version meets it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True)
class ScalingSpec:
    min_replicas: int
    max_replicas: int
    # Requests per second one replica is meant to serve.
    target_rps: float
    # The latency objective (the percentile the replicas report), milliseconds.
    latency_slo_ms: float
    # Fewer replicas only after the load needed fewer for this long.
    scale_down_after_s: float = 300.0
    # ... and only when it needed at most this share of the replicas there are.
    scale_down_below: float = 0.8


@dataclass(frozen=True)
class LoadReport:
    replica: str
    at: float
    rps: float
    latency_ms: float


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    reason: str


def needed(spec: ScalingSpec, rps: float) -> int:
    """Replicas the total load needs at the target load per replica."""
    if spec.target_rps <= 0:
        return spec.min_replicas
    return math.ceil(max(rps, 0.0) / spec.target_rps - 1e-9)


def desired_replicas(
    spec: ScalingSpec,
    current: int,
    reports: Sequence[LoadReport],
    now: float,
    last_change_at: float,
    window_s: float = 30.0,
) -> ScaleDecision:
    """The replica count for the load reported: each replica's newest report within
    `window_s`, summed; the scale-down window reads every report since `scale_down_after_s`.
    `last_change_at` is when the count last changed (a scale-down waits a full window after
    it, so it judges the new count)."""
    low, high = spec.min_replicas, max(spec.min_replicas, spec.max_replicas)
    current = min(max(current, low), high)
    recent = _newest(r for r in reports if now - r.at <= window_s)
    if not recent:
        return ScaleDecision(current, "no load reported lately: the count stays")
    rps = sum(r.rps for r in recent)
    latency = max(r.latency_ms for r in recent)
    want = needed(spec, rps)
    if want > current or latency > spec.latency_slo_ms:
        target = max(want, current + 1 if latency > spec.latency_slo_ms else current)
        target = min(target, high)
        if target > current:
            why = (
                f"latency {latency:g} ms above the objective {spec.latency_slo_ms:g} ms"
                if latency > spec.latency_slo_ms and want <= current
                else f"{rps:g} requests/s need {want} replica(s) at {spec.target_rps:g} each"
            )
            return ScaleDecision(target, why)
        return ScaleDecision(current, f"at the maximum of {high} replica(s)")
    window_start = now - spec.scale_down_after_s
    if last_change_at > window_start:
        return ScaleDecision(current, "the last change is too recent to shrink")
    # The most any moment of the window needed: reports grouped by the second they came.
    peak = _peak_needed(spec, [r for r in reports if r.at >= window_start])
    target = max(peak, low)
    if target < current and target <= spec.scale_down_below * current:
        return ScaleDecision(
            target,
            f"for {spec.scale_down_after_s:g} s the load needed at most {peak} replica(s)",
        )
    return ScaleDecision(current, "the load fits the replicas there are")


def _newest(reports: Iterable[LoadReport]) -> list[LoadReport]:
    newest: dict[str, LoadReport] = {}
    for r in reports:
        if r.replica not in newest or r.at > newest[r.replica].at:
            newest[r.replica] = r
    return list(newest.values())


def _peak_needed(spec: ScalingSpec, reports: Sequence[LoadReport]) -> int:
    """The most replicas the load needed at any report time of the window: at each report,
    the sum of every replica's newest report so far."""
    latest: dict[str, float] = {}
    peak = 0
    for r in sorted(reports, key=lambda r: (r.at, r.replica)):
        latest[r.replica] = r.rps
        peak = max(peak, needed(spec, sum(latest.values())))
    return peak


class ReplicaState(StrEnum):
    STARTING = "starting"  # placed or waiting to be: not serving yet
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class Replica:
    replica: str
    version: str
    state: ReplicaState
    since: float  # when it entered its state
    latency_ms: float | None = None  # its latest report, when ready


@dataclass(frozen=True)
class RolloutSpec:
    max_surge: int = 1
    max_unavailable: int = 0
    ready_timeout_s: float = 600.0
    latency_slo_ms: float = math.inf


class RolloutPhase(StrEnum):
    ROLLING = "rolling"
    DONE = "done"
    ROLLING_BACK = "rolling_back"


@dataclass
class RolloutStep:
    phase: RolloutPhase
    # How many replicas of `version` to start now, and which replicas to stop.
    start: int = 0
    version: str = ""
    stop: list[str] = field(default_factory=list)
    reason: str = ""


def rollout_step(
    spec: RolloutSpec,
    desired: int,
    old: str,
    new: str,
    replicas: Sequence[Replica],
    now: float,
) -> RolloutStep:
    """The next step from `old` to `new` for a service that should have `desired` replicas.
    When the new version fails, the step is the start of the way back: the roll-back is the
    same update from `new` to `old` (call again with them swapped)."""
    live = [r for r in replicas if r.state is not ReplicaState.FAILED]
    fresh = [r for r in live if r.version == new]
    stale = [r for r in live if r.version != new]
    broken = _broken(spec, new, old, replicas, now)
    if broken:
        # Stop the new replicas not serving; the ready ones stay until old ones are ready
        # again (the roll-back is an update like any other, from `new` to `old`).
        doomed = sorted(r.replica for r in fresh if r.state is not ReplicaState.READY)
        return RolloutStep(RolloutPhase.ROLLING_BACK, version=old, stop=doomed, reason=broken)
    surge = spec.max_surge if spec.max_surge > 0 or spec.max_unavailable > 0 else 1
    ready_new = [r for r in fresh if r.state is ReplicaState.READY]
    if not stale and len(ready_new) >= desired:
        keep = sorted(fresh, key=lambda r: (r.state is not ReplicaState.READY, r.since, r.replica))
        extra = sorted(r.replica for r in keep[desired:])
        return RolloutStep(RolloutPhase.DONE, stop=extra, reason=f"{desired} replica(s) of {new}")
    ready = sum(1 for r in live if r.state is ReplicaState.READY)
    # Old replicas not serving go at once; ready old ones only as far as the ready count stays
    # at or above desired - max_unavailable (with 0 unavailable: one per new one ready beyond
    # the desired count).
    stop = sorted(r.replica for r in stale if r.state is not ReplicaState.READY)
    ready_old = sorted(
        (r for r in stale if r.state is ReplicaState.READY), key=lambda r: (r.since, r.replica)
    )
    can_stop = max(min(ready - max(desired - spec.max_unavailable, 0), len(ready_old)), 0)
    stop += [r.replica for r in ready_old[:can_stop]]
    after = len(live) - len(stop)
    start = max(min(desired + surge - after, desired - len(fresh)), 0)
    return RolloutStep(
        RolloutPhase.ROLLING,
        start=start,
        version=new,
        stop=stop,
        reason=f"{len(ready_new)} of {desired} replica(s) on {new} ready",
    )


def _broken(spec: RolloutSpec, new: str, old: str, replicas: Sequence[Replica], now: float) -> str:
    """Why the new version must be rolled back, or '' while it is healthy."""
    for r in replicas:
        if r.version != new:
            continue
        if r.state is ReplicaState.FAILED:
            return f"replica {r.replica} of {new} failed"
        if r.state is ReplicaState.STARTING and now - r.since > spec.ready_timeout_s:
            return f"replica {r.replica} of {new} not ready after {spec.ready_timeout_s:g} s"
    new_latency = [r.latency_ms for r in replicas if r.version == new and r.latency_ms is not None]
    old_latency = [r.latency_ms for r in replicas if r.version == old and r.latency_ms is not None]
    new_misses = bool(new_latency) and max(new_latency) > spec.latency_slo_ms
    old_meets = not old_latency or max(old_latency) <= spec.latency_slo_ms
    if new_misses and old_meets:
        return (
            f"{new} answers in {max(new_latency):g} ms, above the objective "
            f"{spec.latency_slo_ms:g} ms that {old} meets"
        )
    return ""
