"""The chaos fault plan is complete and reproducible: every kind of service is hit whatever
the timing, the same seed draws the same plan, and faults follow one another in order."""

from __future__ import annotations

import pytest

from bench.chaos import FREEZE, LEADER, STANDBY, fault_plan, fault_targets

STACK = [
    "gateway",
    "queue",
    "scheduler",
    "preemptor",
    "health",
    "meter",
    "scheduler-standby",
    "executor-onprem-h100",
    "executor-cloud-a100",
    "executor-tpu",
]


def test_targets_are_every_kind_with_the_scheduler_by_role() -> None:
    targets = fault_targets(STACK)
    assert LEADER in targets and STANDBY in targets
    assert not any(t.startswith("scheduler") for t in targets if t not in (LEADER, STANDBY))
    assert {"gateway", "queue", "preemptor", "health", "meter"} <= set(targets)
    assert sum(t.startswith("executor") for t in targets) == 3


@pytest.mark.parametrize("seed", [1, 3, 7, 42])
@pytest.mark.parametrize(("seconds", "every_s"), [(20, 8), (60, 5), (120, 8), (600, 6)])
def test_every_target_is_planned_at_least_once_in_order(
    seed: int, seconds: float, every_s: float
) -> None:
    targets = fault_targets(STACK)
    plan = fault_plan(targets, seconds, every_s, seed)
    assert set(targets) | {FREEZE} == {f.target for f in plan}
    times = [f.at_s for f in plan]
    assert times == sorted(times) and times[0] > 0 and times[-1] < seconds
    assert all(0.2 <= f.down_s <= 2.0 for f in plan if f.target != FREEZE)
    # A freeze lasts longer than the 3 s lease, so the standby really takes over.
    assert all(4.0 <= f.down_s <= 6.0 for f in plan if f.target == FREEZE)


def test_the_same_seed_draws_the_same_plan() -> None:
    targets = fault_targets(STACK)
    assert fault_plan(targets, 60, 5, 3) == fault_plan(targets, 60, 5, 3)
    assert fault_plan(targets, 60, 5, 3) != fault_plan(targets, 60, 5, 4)


def test_a_long_run_hits_every_target_once_per_round() -> None:
    targets = fault_targets(STACK)
    plan = fault_plan(targets, 600, 6, 1)
    rounds = len(plan) // (len(targets) + 1)
    assert rounds >= 2
    for target in [*targets, FREEZE]:
        assert sum(f.target == target for f in plan) == rounds
