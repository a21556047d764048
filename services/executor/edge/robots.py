"""A simulated robot fleet (pure, times passed in): robots with an onboard accelerator, a site
and labels, behind a link that drops; each installs the model version it should run when it is
online, switches to it in one step (never two versions of a model at once) and judges its
health on it.

The fleet comes from the fleet file's `robot_fleets:` (docs/serving.md, "Robot fleets"):

    robot_fleets:
      - name: robots
        kind: edge
        sites:
          - {site: lab-a, count: 24, accelerator_type: Jetson-Orin, labels: {model: mk2},
             flaky_share: 0.1}

Robots are named `<site>-<nnn>`. A flaky robot's link follows a fixed schedule (offline for
`offline_share` of every `flap_period_s`, at a phase drawn from its name), so a run repeats.
A version's health on the robot comes from the desired state's labels, as a job's behaviour
on the simulated fleet comes from its labels: `sim_health: failed` makes the model's own check
fail on every robot that runs it. Faults (`qm fault robot`) take a robot's link down or make
it unhealthy on whatever it runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from schemas.robots import MAX_ROBOTS, ModelHealth, RobotState

HEALTH_LABEL = "sim_health"
INSTALL_LABEL = "sim_install_s"
DEFAULT_INSTALL_S = 30.0  # fleet seconds to download and load a model version


class RobotFleetError(ValueError):
    pass


@dataclass(frozen=True)
class Desired:
    version: str
    deployment: str
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Verdict:
    version: str
    healthy: bool
    since: float
    detail: str = ""


@dataclass
class SimRobot:
    robot: str
    site: str
    accelerator_type: str
    labels: dict[str, str]
    flaky: bool = False
    phase: float = 0.0  # where in its flap period it starts (0..1)
    online: bool = True
    last_seen: float = 0.0
    link_down: bool = False  # a fault: offline until brought back
    sick: bool = False  # a fault: unhealthy on whatever it runs
    running: dict[str, str] = field(default_factory=dict)
    installing: dict[str, tuple[str, float]] = field(default_factory=dict)  # model: version, done
    health: dict[str, Verdict] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetConfig:
    flap_period_s: float = 600.0  # fleet seconds
    offline_share: float = 0.3
    install_s: float = DEFAULT_INSTALL_S


def load_robot_fleet(doc: Mapping[str, Any], name: str) -> tuple[list[SimRobot], FleetConfig]:
    """The robots of fleet `name` in a fleet file's `robot_fleets:`."""
    for raw in doc.get("robot_fleets") or []:
        if raw.get("name") != name:
            continue
        robots: list[SimRobot] = []
        for i, site in enumerate(raw.get("sites") or []):
            where = f"robot_fleets[{name}].sites[{i}]"
            try:
                count = int(site["count"])
                site_name = str(site["site"])
                share = float(site.get("flaky_share", 0.0))
            except (KeyError, TypeError, ValueError) as error:
                raise RobotFleetError(f"{where}: {error}") from None
            if count < 0 or not 0 <= share <= 1:
                raise RobotFleetError(f"{where}: count >= 0 and 0 <= flaky_share <= 1")
            # The flaky robots are spread through the site.
            flaky = {n * count // k for k in [round(share * count)] if k for n in range(k)}
            for n in range(count):
                robot_id = f"{site_name}-{n:03d}"
                robots.append(
                    SimRobot(
                        robot=robot_id,
                        site=site_name,
                        accelerator_type=str(site.get("accelerator_type", "Jetson-Orin")),
                        labels={str(k): str(v) for k, v in (site.get("labels") or {}).items()},
                        flaky=n in flaky,
                        phase=_unit(robot_id),
                    )
                )
        if len(robots) > MAX_ROBOTS:
            raise RobotFleetError(
                f"robot_fleets[{name}]: {len(robots)} robots; a fleet holds at most "
                f"{MAX_ROBOTS} (split it into several fleets)"
            )
        config = FleetConfig(
            flap_period_s=float(raw.get("flap_period_s", 600.0)),
            offline_share=float(raw.get("offline_share", 0.3)),
            install_s=float(raw.get("install_s", DEFAULT_INSTALL_S)),
        )
        return robots, config
    raise RobotFleetError(f"the fleet file has no robot fleet named {name!r}")


def robot_fleet_names(doc: Mapping[str, Any]) -> list[str]:
    return [str(f["name"]) for f in doc.get("robot_fleets") or [] if "name" in f]


def _unit(text: str) -> float:
    """A number in [0, 1) drawn from a name (the same on every run)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64


def link_up(robot: SimRobot, config: FleetConfig, fleet_s: float) -> bool:
    if robot.link_down:
        return False
    if not robot.flaky:
        return True
    period = max(config.flap_period_s, 1e-9)
    at = (fleet_s / period + robot.phase) % 1.0
    return at >= config.offline_share


def step(
    robot: SimRobot,
    desired: Mapping[str, Desired],
    config: FleetConfig,
    now: float,
    time_scale: float,
) -> bool:
    """Advance one robot to `now` (wall seconds); True when what it reports changed."""
    fleet_s = now * time_scale
    before = (
        robot.online,
        dict(robot.running),
        {m: (v.version, v.healthy) for m, v in robot.health.items()},
    )
    robot.online = link_up(robot, config, fleet_s)
    if robot.online:
        robot.last_seen = now
        for model, want in desired.items():
            if robot.running.get(model) == want.version:
                robot.installing.pop(model, None)
                continue
            got = robot.installing.get(model)
            if got is None or got[0] != want.version:
                install_s = _number(want.labels.get(INSTALL_LABEL), config.install_s)
                robot.installing[model] = (want.version, now + install_s / time_scale)
            elif got[1] <= now:
                # The switch: the old version stops as the new one starts.
                robot.running[model] = want.version
                del robot.installing[model]
                robot.health[model] = _verdict(robot, want, now)
        for model, version in robot.running.items():
            verdict = robot.health.get(model)
            now_wanted = desired.get(model)
            labels = (
                now_wanted.labels
                if now_wanted is not None and now_wanted.version == version
                else {}
            )
            healthy = not robot.sick and labels.get(HEALTH_LABEL) != "failed"
            if verdict is None or verdict.version != version or verdict.healthy != healthy:
                robot.health[model] = _verdict(robot, Desired(version, "", labels), now)
    else:
        robot.installing.clear()  # the download starts again when the link is back
    after = (
        robot.online,
        dict(robot.running),
        {m: (v.version, v.healthy) for m, v in robot.health.items()},
    )
    return before != after


def _verdict(robot: SimRobot, want: Desired, now: float) -> Verdict:
    if robot.sick:
        return Verdict(want.version, False, now, "fault injected: inference errors")
    if want.labels.get(HEALTH_LABEL) == "failed":
        return Verdict(want.version, False, now, f"the model's check failed on {want.version}")
    return Verdict(want.version, True, now)


def _number(raw: str | None, default: float) -> float:
    try:
        value = float(raw) if raw is not None else default
    except ValueError:
        return default
    return value if value >= 0 and value == value and value != float("inf") else default


def state_of(robot: SimRobot) -> RobotState:
    return RobotState(
        robot=robot.robot,
        site=robot.site,
        accelerator_type=robot.accelerator_type,
        labels=robot.labels,
        online=robot.online,
        last_seen=datetime.fromtimestamp(robot.last_seen, UTC),
        running=dict(robot.running),
        health=[
            ModelHealth(
                model=model,
                version=v.version,
                healthy=v.healthy,
                since=datetime.fromtimestamp(v.since, UTC),
                error_rate=0.0 if v.healthy else 0.4,
                detail=v.detail,
            )
            for model, v in sorted(robot.health.items())
        ],
    )
