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
) -> RobotRollout:
    """Which version each robot should run now (see the module docstring)."""
    by_id = {r.robot_id: r for r in robots}
    report = {(h.robot_id, h.version): h for h in health}
    waves = waves_of(spec, robots)
    pinned: dict[str, str] = {}
    for r in robots:
        if r.pinned is not None:
            pinned[r.robot_id] = r.pinned
    sick = sorted(
        h.robot_id
        for h in health
        if h.version == new
        and not h.healthy
        and h.robot_id in by_id
        and by_id[h.robot_id].pinned is None
    )
    if sick:
        detail = report[(sick[0], new)].detail
        back = {r.robot_id: previous for r in robots if r.pinned is None}
        return RobotRollout(
            RolloutState.ROLLED_BACK,
            {**back, **pinned},
            0,
            len(waves),
            f"robot {sick[0]} unhealthy on {new}{': ' + detail if detail else ''}",
        )
    # Waves reached: the first always; the next once every robot of those reached passed and
    # at least one of them is online (an all-offline canary proves nothing).
    reached = 1 if waves else 0
    while reached < len(waves) and _wave_done(waves[:reached], by_id, report, new, spec, now):
        reached += 1
    desired: dict[str, str] = {}
    for k, wave in enumerate(waves):
        for robot_id in wave:
            desired[robot_id] = new if k < reached else previous
    done = reached == len(waves) and _wave_done(waves, by_id, report, new, spec, now)
    state = RolloutState.DONE if done else RolloutState.ROLLING
    reason = (
        f"every online robot runs {new}, healthy for {spec.soak_s:g} s"
        if done
        else f"wave {reached} of {len(waves)}: waiting for its online robots to run {new} "
        f"healthy for {spec.soak_s:g} s"
    )
    return RobotRollout(state, {**desired, **pinned}, reached, len(waves), reason)


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
