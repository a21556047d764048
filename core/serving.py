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
from collections.abc import Collection, Iterable, Sequence
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
    # Shrinking aims at this share of the target per replica (headroom), so the count it
    # shrinks to does not run at the edge and grow straight back.
    scale_down_below: float = 0.8

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError("replicas: need 0 <= min_replicas <= max_replicas")
        if not (math.isfinite(self.target_rps) and self.target_rps > 0):
            raise ValueError("target_rps must be a positive number")
        if math.isnan(self.latency_slo_ms) or self.latency_slo_ms <= 0:
            raise ValueError("latency_slo_ms must be positive")
        if not (math.isfinite(self.scale_down_after_s) and self.scale_down_after_s >= 0):
            raise ValueError("scale_down_after_s must be a non-negative number")
        if not 0 < self.scale_down_below <= 1:
            raise ValueError("scale_down_below must be in (0, 1]")


@dataclass(frozen=True)
class LoadReport:
    replica: str
    at: float
    rps: float
    latency_ms: float

    @property
    def sane(self) -> bool:
        values = (self.at, self.rps, self.latency_ms)
        return all(math.isfinite(v) for v in values) and self.rps >= 0 and self.latency_ms >= 0


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    reason: str


def needed(spec: ScalingSpec, rps: float, share: float = 1.0) -> int:
    """Replicas the total load needs at `share` of the target load per replica."""
    return math.ceil(max(rps, 0.0) / (spec.target_rps * share) - 1e-9)


def desired_replicas(
    spec: ScalingSpec,
    current: int,
    reports: Sequence[LoadReport],
    now: float,
    last_change_at: float,
    live: Collection[str] | None = None,
    window_s: float = 30.0,
) -> ScaleDecision:
    """The replica count for the load reported by the replicas that run (`live`; None: every
    replica that reported): each one's newest report within `window_s`, summed. Latency grows
    the count only on reports made since the last change (the replicas it added had their
    chance). The scale-down window reads every report since `scale_down_after_s`. Reports that
    are not finite, negative or from the future are ignored."""
    low, high = spec.min_replicas, spec.max_replicas
    current = min(max(current, low), high)
    usable = [r for r in reports if r.sane and r.at <= now and (live is None or r.replica in live)]
    recent = _newest(r for r in usable if now - r.at <= window_s)
    if not recent:
        return ScaleDecision(current, "no load reported lately: the count stays")
    rps = sum(r.rps for r in recent)
    want = needed(spec, rps)
    fresh = [r.latency_ms for r in recent if r.at > last_change_at]
    slow = bool(fresh) and max(fresh) > spec.latency_slo_ms
    if want > current or slow:
        target = min(max(want, current + 1 if slow else current), high)
        if target > current:
            why = (
                f"latency {max(fresh):g} ms above the objective {spec.latency_slo_ms:g} ms"
                if slow and want <= current
                else f"{rps:g} requests/s need {want} replica(s) at {spec.target_rps:g} each"
            )
            return ScaleDecision(target, why)
        return ScaleDecision(current, f"at the maximum of {high} replica(s)")
    window_start = now - spec.scale_down_after_s
    if last_change_at > window_start:
        return ScaleDecision(current, "the last change is too recent to shrink")
    window = [r for r in usable if r.at >= window_start]
    if any(r.latency_ms > spec.latency_slo_ms for r in window):
        return ScaleDecision(current, "latency was above the objective in the window")
    peak = _peak_rps(window)
    target = max(needed(spec, peak, spec.scale_down_below), low)
    if target < current:
        return ScaleDecision(
            target,
            f"for {spec.scale_down_after_s:g} s the load peaked at {peak:g} requests/s: "
            f"{target} replica(s) at {spec.scale_down_below:.0%} of the target each",
        )
    return ScaleDecision(current, "the load fits the replicas there are")


def _newest(reports: Iterable[LoadReport]) -> list[LoadReport]:
    newest: dict[str, LoadReport] = {}
    for r in reports:
        if r.replica not in newest or r.at > newest[r.replica].at:
            newest[r.replica] = r
    return list(newest.values())


def _peak_rps(reports: Sequence[LoadReport]) -> float:
    """The highest total load of the window: at each report, the sum of every replica's
    newest report so far."""
    latest: dict[str, float] = {}
    peak = 0.0
    for r in sorted(reports, key=lambda r: (r.at, r.replica)):
        latest[r.replica] = r.rps
        peak = max(peak, sum(latest.values()))
    return peak


class ReplicaState(StrEnum):
    PENDING = "pending"  # waiting to be placed (for capacity, quota): not timed
    STARTING = "starting"  # placed, not serving yet: ready within the timeout, or it hangs
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

    def __post_init__(self) -> None:
        if self.max_surge < 0 or self.max_unavailable < 0:
            raise ValueError("max_surge and max_unavailable must not be negative")
        if math.isnan(self.ready_timeout_s) or self.ready_timeout_s <= 0:
            raise ValueError("ready_timeout_s must be positive")
        if math.isnan(self.latency_slo_ms) or self.latency_slo_ms <= 0:
            raise ValueError("latency_slo_ms must be positive")


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
    started_at: float = -math.inf,
) -> RolloutStep:
    """The next step from `old` to `new` for a service that should have `desired` replicas,
    in an update that began at `started_at` (failures from before it are not its). When the
    new version fails, the step is the start of the way back: the roll-back is the same update
    from `new` to `old` (call again with them swapped). A finished update never rolls back."""
    if desired < 0:
        raise ValueError("desired must not be negative")
    live = [r for r in replicas if r.state is not ReplicaState.FAILED]
    fresh = [r for r in live if r.version == new]
    stale = [r for r in live if r.version != new]
    surge = spec.max_surge if spec.max_surge > 0 or spec.max_unavailable > 0 else 1
    ready_new = [r for r in fresh if r.state is ReplicaState.READY]
    if not stale and len(ready_new) >= desired:
        keep = sorted(fresh, key=lambda r: (r.state is not ReplicaState.READY, r.since, r.replica))
        extra = sorted(r.replica for r in keep[desired:])
        return RolloutStep(RolloutPhase.DONE, stop=extra, reason=f"{desired} replica(s) of {new}")
    broken = _broken(spec, new, old, replicas, now, started_at)
    if broken:
        # Stop the new replicas not serving; the ready ones stay until old ones are ready
        # again (the roll-back is an update like any other, from `new` to `old`).
        doomed = sorted(r.replica for r in fresh if r.state is not ReplicaState.READY)
        return RolloutStep(RolloutPhase.ROLLING_BACK, version=old, stop=doomed, reason=broken)
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


def _broken(
    spec: RolloutSpec,
    new: str,
    old: str,
    replicas: Sequence[Replica],
    now: float,
    started_at: float,
) -> str:
    """Why the new version must be rolled back, or '' while it is healthy: a replica of it
    failed during this update, or was placed and is not ready in time (waiting to be placed is
    not a hang), or it answers above the latency objective while ready replicas of the old
    version answer within it."""
    for r in replicas:
        if r.version != new:
            continue
        if r.state is ReplicaState.FAILED and r.since >= started_at:
            return f"replica {r.replica} of {new} failed"
        if r.state is ReplicaState.STARTING and now - r.since > spec.ready_timeout_s:
            return f"replica {r.replica} of {new} not ready after {spec.ready_timeout_s:g} s"

    def latencies(version: str) -> list[float]:
        return [
            r.latency_ms
            for r in replicas
            if r.version == version
            and r.state is ReplicaState.READY
            and r.latency_ms is not None
            and math.isfinite(r.latency_ms)
        ]

    new_latency, old_latency = latencies(new), latencies(old)
    judged = bool(new_latency) and bool(old_latency)
    if judged and max(new_latency) > spec.latency_slo_ms >= max(old_latency):
        return (
            f"{new} answers in {max(new_latency):g} ms, above the objective "
            f"{spec.latency_slo_ms:g} ms that {old} meets"
        )
    return ""
