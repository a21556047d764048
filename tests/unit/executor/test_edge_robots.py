"""The simulated robot fleet: loaded from the fleet file, flaky links on a fixed schedule, a
version switched in one step after its install, never while the link is down."""

from __future__ import annotations

import pytest

from cli.stack import PROJECT_ROOT
from services.common.policyfile import read_yaml
from services.executor.edge.robots import (
    Desired,
    FleetConfig,
    RobotFleetError,
    link_up,
    load_robot_fleet,
    step,
)

EXAMPLES = PROJECT_ROOT / "examples"


def test_the_example_fleet_has_two_sites_and_some_flaky_robots() -> None:
    robots, config = load_robot_fleet(read_yaml(EXAMPLES / "fleet.yaml"), "robots")
    sites = {r.site for r in robots}
    assert sites == {"lab-a", "lab-b"} and len(robots) == 40
    flaky = [r for r in robots if r.flaky]
    assert len(flaky) == round(0.1 * 24) + round(0.25 * 16)
    assert config.install_s == 30


def test_a_bad_fleet_is_refused_with_where() -> None:
    with pytest.raises(RobotFleetError, match="no robot fleet named"):
        load_robot_fleet({"robot_fleets": []}, "robots")
    doc = {"robot_fleets": [{"name": "r", "sites": [{"site": "x", "count": "many"}]}]}
    with pytest.raises(RobotFleetError, match=r"sites\[0\]"):
        load_robot_fleet(doc, "r")
    huge = {"robot_fleets": [{"name": "r", "sites": [{"site": "x", "count": 5000}]}]}
    with pytest.raises(RobotFleetError, match="split it"):
        load_robot_fleet(huge, "r")


def test_a_flaky_link_follows_its_schedule_and_a_steady_one_stays_up() -> None:
    robots, _ = load_robot_fleet(read_yaml(EXAMPLES / "fleet.yaml"), "robots")
    config = FleetConfig(flap_period_s=100, offline_share=0.3)
    flaky = next(r for r in robots if r.flaky)
    steady = next(r for r in robots if not r.flaky)
    ups = [link_up(flaky, config, t) for t in range(0, 1000)]
    assert 0.65 < sum(ups) / len(ups) < 0.75  # offline 30 % of the time
    assert ups == [link_up(flaky, config, t) for t in range(0, 1000)]  # the same every run
    assert all(link_up(steady, config, t) for t in range(0, 1000))


def test_a_version_switches_after_its_install_and_never_over_a_down_link() -> None:
    robots, _ = load_robot_fleet(read_yaml(EXAMPLES / "fleet.yaml"), "robots")
    robot = next(r for r in robots if not r.flaky)
    config = FleetConfig(install_s=10)
    want = {"nav": Desired("v1", "nav")}
    step(robot, want, config, 0.0, 1.0)
    step(robot, want, config, 5.0, 1.0)
    assert robot.running == {}  # still installing
    robot.link_down = True
    step(robot, want, config, 11.0, 1.0)
    assert robot.running == {} and not robot.online
    robot.link_down = False
    step(robot, want, config, 12.0, 1.0)  # the download starts again
    assert robot.running == {}
    assert step(robot, want, config, 22.0, 1.0)  # reported: it changed
    assert robot.running == {"nav": "v1"} and robot.health["nav"].healthy
    # Unhealthy on whatever it runs, by a fault.
    robot.sick = True
    step(robot, want, config, 23.0, 1.0)
    assert not robot.health["nav"].healthy
