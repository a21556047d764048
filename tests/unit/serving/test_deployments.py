"""Robot deployments in the serving service's books, driven by simulated robots (the edge
executor's model) without I/O: waves open on health, a failed canary rolls everything back,
an offline robot catches up when it returns, a pinned robot keeps its version, a paused
deployment opens no wave, and only changes are published."""

from __future__ import annotations

from schemas.robots import (
    DeploymentAction,
    DeploymentCommand,
    DeploymentPhase,
    RobotDeploymentSpec,
    RobotInventory,
    RobotSelector,
)
from services.executor.edge.robots import Desired, FleetConfig, SimRobot, state_of, step
from services.serving.deployments import Deployments, Refused

T0 = 1_000_000.0
CONFIG = FleetConfig(install_s=2.0)


def fleet(n: int = 20) -> list[SimRobot]:
    return [
        SimRobot(f"lab-a-{i:03d}", "lab-a", "Jetson-Orin", {"robot_model": "mk2"}) for i in range(n)
    ]


def spec(version: str, **over: object) -> RobotDeploymentSpec:
    base = {
        "name": "nav",
        "tenant": "vision",
        "model": "nav-policy",
        "version": version,
        "to": RobotSelector(sites=["lab-a"]),
        "canary_share": 0.1,
        "wave_share": 0.5,
        "soak_s": 5.0,
    }
    return RobotDeploymentSpec.model_validate({**base, **over})


class Loop:
    """The serving book and the robots, one second per tick."""

    def __init__(self, robots: list[SimRobot]) -> None:
        self.robots = robots
        self.book = Deployments()
        self.desired: dict[str, dict[str, Desired]] = {r.robot: {} for r in robots}
        self.now = T0
        self.published: list[tuple[str, str]] = []
        self.waves_seen: list[int] = []

    def tick(self) -> None:
        for r in self.robots:
            step(r, self.desired[r.robot], CONFIG, self.now, 1.0)
        self.book.inventory(
            RobotInventory(cluster="robots", robots=[state_of(r) for r in self.robots]),
            self.now,
        )
        out = self.book.round(self.now)
        for d in out.desired:
            self.desired[d.robot][d.model] = Desired(d.version, d.deployment, d.labels)
            self.published.append((d.robot, d.version))
        for s in out.statuses:
            self.waves_seen.append(s.wave)
        self.now += 1.0

    def run(self, seconds: int) -> None:
        for _ in range(seconds):
            self.tick()

    def running(self, version: str) -> int:
        return sum(1 for r in self.robots if r.running.get("nav-policy") == version)


def test_a_rollout_opens_waves_on_health_and_reaches_every_robot() -> None:
    loop = Loop(fleet())
    loop.book.declare(spec("v1"), loop.now)
    loop.run(40)
    rec = loop.book.records["nav"]
    assert rec.phase is DeploymentPhase.DONE and loop.running("v1") == 20
    # The canary (2 robots) first, then waves of 10: never all at once.
    assert loop.waves_seen[0] == 1 and sorted(set(loop.waves_seen)) == [1, 2, 3]
    first = [robot for robot, _ in loop.published[:2]]
    assert first == ["lab-a-000", "lab-a-001"]
    # Each robot was told once.
    assert len(loop.published) == 20


def test_a_failed_canary_rolls_everything_back_and_no_wave_opens() -> None:
    loop = Loop(fleet())
    loop.book.declare(spec("v1"), loop.now)
    loop.run(40)
    loop.book.declare(spec("v2", labels={"sim_health": "failed"}), loop.now)
    loop.run(20)
    rec = loop.book.records["nav"]
    assert rec.phase is DeploymentPhase.ROLLED_BACK, rec.reason
    assert "unhealthy on v2" in rec.reason and "check failed" in rec.reason
    assert rec.reached == 1  # only the canary was ever told v2
    told_v2 = {robot for robot, v in loop.published if v == "v2"}
    assert told_v2 == {"lab-a-000", "lab-a-001"}
    assert loop.running("v1") == 20 and loop.running("v2") == 0


def test_an_offline_robot_catches_up_when_it_returns_and_a_pinned_one_stays() -> None:
    robots = fleet()
    robots[5].link_down = True
    loop = Loop(robots)
    loop.book.declare(spec("v1"), loop.now)
    loop.run(40)
    loop.book.command(
        DeploymentCommand(
            deployment="nav",
            tenant="vision",
            action=DeploymentAction.PIN,
            robot="lab-a-007",
            version="v1",
        ),
        loop.now,
    )
    loop.book.declare(spec("v2"), loop.now)
    loop.run(40)
    rec = loop.book.records["nav"]
    assert rec.phase is DeploymentPhase.DONE  # the offline robot held nothing back
    assert robots[5].running == {}  # it never got v1 or v2 while away
    assert robots[7].running["nav-policy"] == "v1"  # pinned
    assert loop.running("v2") == 18
    robots[5].link_down = False
    loop.run(5)
    assert robots[5].running["nav-policy"] == "v2"


def test_a_paused_deployment_opens_no_wave_until_resumed() -> None:
    loop = Loop(fleet())
    loop.book.declare(spec("v1"), loop.now)
    loop.run(3)
    pause = DeploymentCommand(deployment="nav", tenant="vision", action=DeploymentAction.PAUSE)
    loop.book.command(pause, loop.now)
    loop.run(30)
    assert loop.book.records["nav"].reached == 1 and loop.running("v1") == 2
    resume = pause.model_copy(update={"action": DeploymentAction.RESUME})
    loop.book.command(resume, loop.now)
    loop.run(40)
    assert loop.running("v1") == 20


def test_a_finished_rollout_rolls_nothing_back_later() -> None:
    loop = Loop(fleet())
    loop.book.declare(spec("v1"), loop.now)
    loop.run(40)
    loop.book.declare(spec("v2"), loop.now)
    loop.run(40)
    assert loop.book.records["nav"].phase is DeploymentPhase.DONE
    loop.robots[4].sick = True  # an hour later, one robot is unwell
    loop.run(10)
    assert loop.book.records["nav"].phase is DeploymentPhase.DONE
    assert loop.running("v2") == 20


def test_a_new_version_mid_rollout_sends_no_robot_back() -> None:
    loop = Loop(fleet())
    loop.book.declare(spec("v1"), loop.now)
    loop.run(40)
    loop.book.declare(spec("v2"), loop.now)
    loop.run(9)  # the canary and the next wave run v2
    on_v2 = {r.robot for r in loop.robots if r.running.get("nav-policy") == "v2"}
    assert 2 <= len(on_v2) < 20
    on_v1 = {r.robot for r in loop.robots if r.running.get("nav-policy") == "v1"}
    loop.published.clear()
    loop.book.declare(spec("v3"), loop.now)
    loop.run(3)
    assert all(v == "v3" for _, v in loop.published), loop.published
    # Nobody went back to v1.
    assert {r.robot for r in loop.robots if r.running.get("nav-policy") == "v1"} <= on_v1


def test_robots_never_told_by_a_deployment_are_left_alone_by_its_roll_back() -> None:
    robots = fleet()
    loop = Loop(robots)
    loop.book.declare(spec("v1", to=RobotSelector(robots=["lab-a-000", "lab-a-001"])), loop.now)
    loop.run(20)
    loop.book.declare(spec("v2", labels={"sim_health": "failed"}), loop.now)  # now every robot
    loop.run(20)
    assert loop.book.records["nav"].phase is DeploymentPhase.ROLLED_BACK
    told_v1 = {robot for robot, v in loop.published if v == "v1"}
    assert told_v1 == {"lab-a-000", "lab-a-001"}
    assert all(not r.running for r in robots[2:])  # never ran this model, never told to


def test_one_model_is_deployed_by_one_deployment_and_stale_inventories_hold() -> None:
    loop = Loop(fleet())
    loop.book.declare(spec("v1"), loop.now)
    try:
        loop.book.declare(spec("v9", name="intruder", tenant="nlp"), loop.now)
        raise AssertionError("a second deployment of the model was accepted")
    except Refused as error:
        assert "deployed by 'nav'" in str(error)
    loop.run(2)
    # The edge executor goes away: its last inventory is trusted 30 s, then the rollout holds.
    book, now = loop.book, loop.now + 31
    out = book.round(now)
    assert out.desired == [] and book.records["nav"].reason.startswith("holding")
