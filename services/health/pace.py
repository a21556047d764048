"""The straggler detector, pure: how each node of a gang paces against its peers in one
progress report, and which nodes have been slow in n of the last m reports of a job.

A job's `Track` keeps, per node, its last m verdicts (slow or not). A node starts straggling
when n of them are slow and stops only after m in a row that are not, or when the job's reports
for it stop: the gap between the two edges is the hysteresis that keeps a noisy step time from
alerting, and a straggler from flapping in and out of its incident. Nothing here reads a clock.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from services.health.rules import StragglerRules


@dataclass(frozen=True)
class ReplicaStep:
    replica: int
    node_id: str
    step_time_s: float  # > 0, checked at the edge


@dataclass(frozen=True)
class Progress:
    """One `job.progress` report, as the decisions need it."""

    job_id: str
    attempt: int
    cluster: str
    replicas: tuple[ReplicaStep, ...]
    at: datetime


@dataclass(frozen=True)
class Pace:
    """One node in one report: its slowest replica against the median of the other replicas."""

    node_id: str
    replica: int
    ratio: float
    slow: bool


@dataclass(frozen=True)
class NodeWindow:
    node_id: str
    last_at: datetime  # its last report: the window expires from here
    recent: tuple[bool, ...] = ()  # the last m verdicts, oldest first; True is slow
    straggling: bool = False
    replica: int = 0  # its slowest replica and ratio in the last report
    ratio: float = 1.0

    def slow_count(self) -> int:
        return sum(self.recent)


@dataclass(frozen=True)
class Track:
    """What the detector remembers of one job: the windows of the nodes its gang runs on."""

    job_id: str
    attempt: int
    cluster: str
    last_at: datetime  # the last report judged: older or repeated ones are ignored
    nodes: tuple[NodeWindow, ...]  # by node id

    def window(self, node_id: str) -> NodeWindow | None:
        return next((w for w in self.nodes if w.node_id == node_id), None)

    def straggling(self, node_id: str) -> bool:
        w = self.window(node_id)
        return w is not None and w.straggling


@dataclass(frozen=True)
class Straggle:
    """A node that just became a straggler on a job."""

    node_id: str
    job_id: str
    cluster: str
    replica: int
    ratio: float
    slow_reports: int  # of the last m
    m: int
    at: datetime

    def label(self) -> str:
        return (
            f"job {self.job_id} replica {self.replica} {self.ratio:.1f}x slower than its peers' "
            f"median in {self.slow_reports} of the last {self.m} reports"
        )


@dataclass(frozen=True)
class Observed:
    track: Track
    started: tuple[Straggle, ...] = ()
    slow_again: tuple[str, ...] = ()  # nodes already straggling, slow in this report too
    ended: tuple[str, ...] = ()  # nodes that stopped straggling on this job


def paces(replicas: Sequence[ReplicaStep], slowdown: float) -> tuple[Pace, ...]:
    """Each replica against the median step time of the *other* replicas (with two replicas:
    the other one); a node's pace is its slowest replica's. Needs at least two replicas."""
    times = sorted(r.step_time_s for r in replicas)
    worst: dict[str, Pace] = {}
    for r in sorted(replicas, key=lambda r: r.replica):
        peers = _median_without(times, r.step_time_s)
        ratio = r.step_time_s / peers
        pace = Pace(r.node_id, r.replica, ratio, ratio > slowdown)
        if r.node_id not in worst or ratio > worst[r.node_id].ratio:
            worst[r.node_id] = pace
    return tuple(worst[n] for n in sorted(worst))


def _median_without(times: Sequence[float], value: float) -> float:
    """The median of sorted `times` with one occurrence of `value` left out, in O(log n)."""
    gone = bisect.bisect_left(times, value)
    k = len(times) - 1  # the others

    def other(i: int) -> float:
        return times[i if i < gone else i + 1]

    mid = k // 2
    return other(mid) if k % 2 else (other(mid - 1) + other(mid)) / 2


def observe(track: Track | None, report: Progress, rules: StragglerRules) -> Observed | None:
    """Fold one report into its job's track; None when it is ignored: a gang of one, a report
    of an older attempt, or one no newer than the last judged (a redelivery)."""
    if len(report.replicas) < 2:
        return None
    windows: dict[str, NodeWindow] = {}
    ended: list[str] = []
    if track is not None:
        if report.attempt < track.attempt:
            return None
        if report.attempt == track.attempt and report.at <= track.last_at:
            return None
        windows = {w.node_id: w for w in track.nodes}
        if report.attempt > track.attempt:
            # A new run of the job: nodes it left are done with it; nodes it kept keep their
            # history, so a slow node the job came back to is not a new incident.
            on = {r.node_id for r in report.replicas}
            for gone in [n for n in windows if n not in on]:
                if windows.pop(gone).straggling:
                    ended.append(gone)
    started: list[Straggle] = []
    slow_again: list[str] = []
    for pace in paces(report.replicas, rules.slowdown):
        before = windows.get(pace.node_id) or NodeWindow(pace.node_id, report.at)
        recent = (*before.recent, pace.slow)[-rules.m :]
        w = NodeWindow(pace.node_id, report.at, recent, before.straggling, pace.replica, pace.ratio)
        if not before.straggling and w.slow_count() >= rules.n:
            w = replace(w, straggling=True)
            started.append(
                Straggle(
                    pace.node_id,
                    report.job_id,
                    report.cluster,
                    pace.replica,
                    pace.ratio,
                    w.slow_count(),
                    rules.m,
                    report.at,
                )
            )
        elif before.straggling and pace.slow:
            slow_again.append(pace.node_id)
        elif before.straggling and len(recent) >= rules.m and not any(recent):
            w = replace(w, straggling=False)
            ended.append(pace.node_id)
        windows[pace.node_id] = w
    after = Track(
        report.job_id,
        report.attempt,
        report.cluster,
        report.at,
        tuple(windows[n] for n in sorted(windows)),
    )
    return Observed(after, tuple(started), tuple(slow_again), tuple(ended))


def expire(
    track: Track, now: datetime, watch_from: datetime, rules: StragglerRules
) -> tuple[Track | None, tuple[str, ...]]:
    """Drop the windows of nodes whose reports stopped (the job ended, or left the node);
    returns the track (None once empty; the same object when nothing expired) and the nodes
    that stop straggling with it. Age counts from `watch_from` at the earliest, so a restarted
    service does not expire what it has not caught up with yet."""
    kept: list[NodeWindow] = []
    ended: list[str] = []
    for w in track.nodes:
        if (now - max(w.last_at, watch_from)).total_seconds() >= rules.expire_after_s:
            if w.straggling:
                ended.append(w.node_id)
        else:
            kept.append(w)
    if len(kept) == len(track.nodes):
        return track, ()
    return (replace(track, nodes=tuple(kept)) if kept else None), tuple(ended)
