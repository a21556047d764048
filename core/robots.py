"""Rolling a model version out to a fleet of robots in waves (pure): which version each robot
should run now, from what the robots report. The serving service (issue 13, not built yet) will
keep this desired state on the log, so a robot (or its edge executor) that restarts or comes
back online converges to it.

- The robots selected (by site, label or list, outside this module) are put in a fixed order
  (site, then id) and cut into waves: a canary wave of `canary_share` of them (at least one),
  then waves of `wave_share` each.
- A robot in a wave the rollout has reached should run the new version; every other robot keeps
  the version it had before (the previous one). A pinned robot keeps its pinned version and is
  in no wave. Each robot gets exactly one version: it never runs two at once.
- The rollout moves past a wave once every online robot of the waves reached so far runs the
  new version and has reported healthy on it for `soak_s`. Offline robots do not hold it back:
  they get the new version when they come back.
- Any robot reporting unhealthy on the new version rolls the whole rollout back: every robot's
  version is the previous one again.

Nothing here reads a clock; `now` is passed in, in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True)
class Robot:
    robot_id: str
    site: str
    online: bool
    # The version it reports running (None: none yet, or not reported).
    running: str | None = None
    # A version an operator pinned it to: the rollout leaves it alone.
    pinned: str | None = None


@dataclass(frozen=True)
class Health:
    """A robot's latest health report for a version (inference errors, latency, the model's
    own check, judged on the robot or by the edge executor)."""

    robot_id: str
    version: str
    healthy: bool
    since: float  # when it entered this verdict
    detail: str = ""


@dataclass(frozen=True)
class WaveSpec:
    canary_share: float = 0.1
    wave_share: float = 0.3
    soak_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("canary_share", "wave_share"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1]")
        if not (math.isfinite(self.soak_s) and self.soak_s >= 0):
            raise ValueError("soak_s must be a non-negative number")


class RolloutState(StrEnum):
    ROLLING = "rolling"
    DONE = "done"
    ROLLED_BACK = "rolled_back"


@dataclass
class RobotRollout:
    state: RolloutState
    # Robot -> the version it should run now.
    desired: dict[str, str] = field(default_factory=dict)
    # The waves reached (1 = the canary), of how many.
    wave: int = 0
    waves: int = 0
    reason: str = ""


def waves_of(spec: WaveSpec, robots: Sequence[Robot]) -> list[list[str]]:
    """The robots that take part (not pinned), in waves: the canary first."""
    order = sorted((r for r in robots if r.pinned is None), key=lambda r: (r.site, r.robot_id))
    ids = [r.robot_id for r in order]
    if not ids:
        return []
    canary = max(1, math.ceil(spec.canary_share * len(ids)))
    size = max(1, math.ceil(spec.wave_share * len(ids)))
    out = [ids[:canary]]
    for start in range(canary, len(ids), size):
        out.append(ids[start : start + size])
    return out


def rollout_robots(
    spec: WaveSpec,
    new: str,
    previous: str,
    robots: Sequence[Robot],
    health: Sequence[Health],
    now: float,
    *,
    started_at: float = -math.inf,
    reached_before: int = 0,
    waves: Sequence[Sequence[str]] | None = None,
) -> RobotRollout:
    """Which version each robot should run now (see the module docstring). The caller keeps,
    for the rollout it drives, when it started (`started_at`: health reported before it is
    another rollout's), the waves cut when it started (`waves`: a robot selected since joins
    the last wave) and how many waves it had reached (`reached_before`): a rollout never goes
    back a wave except by rolling back, so a robot that returns, reboots or is added does not
    send robots that run the new version back to the previous one."""
    by_id: dict[str, Robot] = {}
    for r in robots:
        if r.robot_id in by_id:
            raise ValueError(f"robot {r.robot_id} is listed twice")
        by_id[r.robot_id] = r
    report: dict[tuple[str, str], Health] = {}
    for h in health:
        key = (h.robot_id, h.version)
        if h.since >= started_at and (key not in report or h.since >= report[key].since):
            report[key] = h
    pinned = {r.robot_id: r.pinned for r in robots if r.pinned is not None}
    cut = _fixed_waves(spec, robots, waves)
    sick = sorted(
        robot_id
        for (robot_id, version), h in report.items()
        if version == new and not h.healthy and robot_id in by_id and robot_id not in pinned
    )
    if sick:
        detail = report[(sick[0], new)].detail
        back = {r.robot_id: previous for r in robots if r.pinned is None}
        return RobotRollout(
            RolloutState.ROLLED_BACK,
            {**back, **pinned},
            0,
            len(cut),
            f"robot {sick[0]} unhealthy on {new}{': ' + detail if detail else ''}",
        )
    if not any(cut):
        return RobotRollout(RolloutState.DONE, dict(pinned), 0, 0, "no robot takes part")
    # Waves reached: at least as many as before; the next once every robot of those reached
    # passed and at least one of them is online (an all-offline canary proves nothing).
    reached = min(max(reached_before, 1), len(cut))
    while reached < len(cut) and _wave_done(cut[:reached], by_id, report, new, spec, now):
        reached += 1
    desired: dict[str, str] = {}
    for k, wave in enumerate(cut):
        for robot_id in wave:
            desired[robot_id] = new if k < reached else previous
    done = reached == len(cut) and _wave_done(cut, by_id, report, new, spec, now)
    state = RolloutState.DONE if done else RolloutState.ROLLING
    reason = (
        f"every online robot runs {new}, healthy for {spec.soak_s:g} s"
        if done
        else f"wave {reached} of {len(cut)}: waiting for its online robots to run {new} "
        f"healthy for {spec.soak_s:g} s"
    )
    return RobotRollout(state, {**desired, **pinned}, reached, len(cut), reason)


def _fixed_waves(
    spec: WaveSpec, robots: Sequence[Robot], waves: Sequence[Sequence[str]] | None
) -> list[list[str]]:
    """The waves as cut when the rollout started, kept to the robots still selected and not
    pinned; robots selected since join the last wave. Without a cut, one is made now."""
    if waves is None:
        return waves_of(spec, robots)
    taking = {r.robot_id for r in robots if r.pinned is None}
    kept = [[i for i in w if i in taking] for w in waves]
    seen = {i for w in kept for i in w}
    late = sorted(taking - seen)
    if late:
        if kept:
            kept[-1].extend(late)
        else:
            kept.append(late)
    return kept  # a wave left empty keeps its place: `reached_before` counts positions


def _wave_done(
    waves: Sequence[Sequence[str]],
    by_id: dict[str, Robot],
    report: dict[tuple[str, str], Health],
    new: str,
    spec: WaveSpec,
    now: float,
) -> bool:
    ids = [i for w in waves for i in w]
    passed = [_passed(by_id[i], report.get((i, new)), new, spec, now) for i in ids]
    return all(passed) and any(by_id[i].online for i in ids)


def _passed(robot: Robot, health: Health | None, new: str, spec: WaveSpec, now: float) -> bool:
    """An offline robot holds nothing back; an online one must run the new version and have
    been healthy on it for the soak time."""
    if not robot.online:
        return True
    return (
        robot.running == new
        and health is not None
        and health.healthy
        and now - health.since >= spec.soak_s
    )
