"""Robot rollouts in waves (core/robots.py): a canary first, the next wave only once the online
robots so far run the new version healthy for the soak time, offline robots never hold it back
and get the version when they return, one unhealthy robot rolls everything back, pinned robots
keep their version, and every robot has exactly one version."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.robots import Health, Robot, RolloutState, WaveSpec, rollout_robots, waves_of

SPEC = WaveSpec(canary_share=0.1, wave_share=0.3, soak_s=60)


def fleet(n: int, offline: set[int] = frozenset(), pinned: set[int] = frozenset()) -> list[Robot]:
    return [
        Robot(
            f"r{i:03d}",
            "lab-a" if i % 2 else "lab-b",
            online=i not in offline,
            running="v1",
            pinned="v0" if i in pinned else None,
        )
        for i in range(n)
    ]


def test_waves_are_a_canary_then_shares_of_the_rest_and_pinned_robots_sit_out() -> None:
    waves = waves_of(SPEC, fleet(20, pinned={3}))
    assert [len(w) for w in waves] == [2, 6, 6, 5]
    assert "r003" not in {r for w in waves for r in w}
    assert waves_of(SPEC, fleet(1)) == [["r000"]]


def converge(robots: list[Robot], desired: dict[str, str]) -> list[Robot]:
    """Online robots switch to what they should run; offline ones cannot."""
    return [
        Robot(r.robot_id, r.site, r.online, desired.get(r.robot_id, r.running), r.pinned)
        if r.online
        else r
        for r in robots
    ]


def healthy(robots: list[Robot], version: str, since: float) -> list[Health]:
    return [Health(r.robot_id, version, True, since) for r in robots if r.running == version]


def test_a_rollout_goes_wave_by_wave_and_an_offline_robot_catches_up_when_back() -> None:
    robots = fleet(20, offline={5})
    step = rollout_robots(SPEC, "v2", "v1", robots, [], now=0)
    assert step.wave == 1 and sorted(k for k, v in step.desired.items() if v == "v2") == [
        "r001",
        "r003",
    ]
    robots = converge(robots, step.desired)
    # Running but not yet healthy for the soak time: the next wave waits.
    assert rollout_robots(SPEC, "v2", "v1", robots, healthy(robots, "v2", 0), now=30).wave == 1
    now, seen = 0.0, []
    while True:
        step = rollout_robots(SPEC, "v2", "v1", robots, healthy(robots, "v2", now - 60), now)
        seen.append(step.wave)
        robots = converge(robots, step.desired)
        if step.state is RolloutState.DONE:
            break
        now += 60
        assert len(seen) < 10
    assert seen == sorted(seen) and seen[-1] == step.waves
    offline = next(r for r in robots if r.robot_id == "r005")
    assert offline.running == "v1" and step.desired["r005"] == "v2"
    # Back online, it is told v2, runs it, and the rollout stays done.
    robots = converge(
        [*robots[:5], Robot("r005", offline.site, True, "v1"), *robots[6:]], step.desired
    )
    assert all(r.running == "v2" for r in robots)


def test_one_unhealthy_robot_rolls_everything_back_and_pinned_robots_keep_their_version() -> None:
    robots = converge(fleet(10, pinned={4}), {f"r{i:03d}": "v2" for i in range(10) if i != 4})
    health = [*healthy(robots, "v2", 0), Health("r007", "v2", False, 50, "error rate 12%")]
    step = rollout_robots(SPEC, "v2", "v1", robots, health, now=100)
    assert step.state is RolloutState.ROLLED_BACK and "error rate 12%" in step.reason
    assert step.desired["r004"] == "v0"
    assert {v for k, v in step.desired.items() if k != "r004"} == {"v1"}


def test_an_all_offline_canary_proves_nothing() -> None:
    robots = fleet(10, offline={1})  # the canary is r001 alone (the first by site, then id)
    step = rollout_robots(SPEC, "v2", "v1", robots, [], now=1000)
    assert step.wave == 1 and step.state is RolloutState.ROLLING


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 10_000),
    flappy=st.floats(0, 0.5),
    bad=st.one_of(st.none(), st.integers(0, 39)),
)
def test_every_robot_has_one_version_and_waves_open_only_on_healthy_online_evidence(
    n: int, seed: int, flappy: float, bad: int | None
) -> None:
    """Robots with flaky links (a share of them go offline and come back at random), maybe
    one that turns unhealthy on the new version: at every step each robot has exactly one of
    the two versions (or its pin), a wave beyond the first opens only when every online robot
    of the waves before runs the new version healthy, and an unhealthy robot means everyone
    on the previous version."""
    rng = random.Random(seed)
    robots = fleet(n, pinned={0} if n > 3 else set())
    waves = waves_of(SPEC, robots)
    health: dict[str, Health] = {}
    now, reached = 0.0, 0
    told_new: set[str] = set()
    for _ in range(30):
        robots = [
            Robot(r.robot_id, r.site, rng.random() >= flappy, r.running, r.pinned) for r in robots
        ]
        step = rollout_robots(
            SPEC,
            "v2",
            "v1",
            robots,
            list(health.values()),
            now,
            waves=waves,
            reached_before=reached,
        )
        opened_now = step.wave > max(reached, 1)
        if step.state is not RolloutState.ROLLED_BACK:
            # Never backwards: a robot once told the new version is not told the old one.
            now_new = {k for k, v in step.desired.items() if v == "v2"}
            assert told_new <= now_new
            told_new, reached = now_new, step.wave
        assert set(step.desired) == {r.robot_id for r in robots}
        for r in robots:
            assert step.desired[r.robot_id] == (r.pinned or step.desired[r.robot_id])
            assert step.desired[r.robot_id] in ({"v1", "v2"} if r.pinned is None else {r.pinned})
        if any(not h.healthy for h in health.values()):
            assert step.state is RolloutState.ROLLED_BACK
        if step.state is RolloutState.ROLLED_BACK:
            assert bad is not None
            assert all(v == "v1" for k, v in step.desired.items() if k != "r000" or n <= 3)
            return
        # A wave opened at this step only on evidence: every online robot of the waves before
        # it runs the new version, healthy (a robot back later catches up without blocking).
        for k in range(1, step.wave if opened_now else 1):
            for robot_id in [i for w in waves[:k] for i in w]:
                robot = next(r for r in robots if r.robot_id == robot_id)
                if robot.online:
                    h = health.get(robot_id)
                    assert robot.running == "v2" and h is not None and h.healthy
        robots = converge(robots, step.desired)
        for r in robots:
            if r.online and r.running == "v2" and r.robot_id not in health:
                sick = bad is not None and r.robot_id == f"r{bad:03d}" and r.pinned is None
                health[r.robot_id] = Health(r.robot_id, "v2", not sick, now)
        now += 60


def test_a_robot_back_or_added_after_the_rollout_sends_no_one_back() -> None:
    """Done with r005 offline; it returns still on v1, and a new robot joins the selection:
    the waves reached stay reached, both are told v2, nobody is told v1."""
    robots = converge(fleet(20, offline={5}), {f"r{i:03d}": "v2" for i in range(20) if i != 5})
    cut = waves_of(SPEC, robots)
    health = healthy(robots, "v2", 0)
    step = rollout_robots(SPEC, "v2", "v1", robots, health, 100, waves=cut, reached_before=4)
    assert step.state is RolloutState.DONE
    back = [
        *robots[:5],
        Robot("r005", "lab-b", True, "v1"),
        *robots[6:],
        Robot("a000", "lab-a", True, "v1"),
    ]
    again = rollout_robots(SPEC, "v2", "v1", back, health, 130, waves=cut, reached_before=step.wave)
    assert set(again.desired.values()) == {"v2"} and again.wave == step.wave


def test_health_from_before_the_rollout_neither_passes_nor_fails_it() -> None:
    robots = converge(fleet(10), {"r001": "v2"})
    old_pass = [Health("r001", "v2", True, 0)]
    step = rollout_robots(SPEC, "v2", "v1", robots, old_pass, now=1000, started_at=990)
    assert step.wave == 1  # yesterday's soak does not count
    old_fail = [Health("r001", "v2", False, 0, "crashed")]
    step = rollout_robots(SPEC, "v2", "v1", robots, old_fail, now=1000, started_at=990)
    assert step.state is RolloutState.ROLLING
    # The newest verdict of a robot is the one that counts.
    recovered = [Health("r001", "v2", False, 995), Health("r001", "v2", True, 996)]
    step = rollout_robots(SPEC, "v2", "v1", robots, recovered, now=1000, started_at=990)
    assert step.state is RolloutState.ROLLING


def test_bad_input_is_refused_and_an_empty_selection_is_done() -> None:
    with pytest.raises(ValueError):
        rollout_robots(SPEC, "v2", "v1", [*fleet(2), fleet(1)[0]], [], 0)
    with pytest.raises(ValueError):
        WaveSpec(canary_share=float("nan"))
    pinned = fleet(2, pinned={0, 1})
    step = rollout_robots(SPEC, "v2", "v1", pinned, [], 0)
    assert step.state is RolloutState.DONE and step.desired == {"r000": "v0", "r001": "v0"}
