"""Inference services' decisions (core/serving.py): replicas follow the load within min and max,
grow at once and shrink only after a quiet window; a rolling update keeps the ready count and
the surge within bounds at every step, finishes on the new version, and rolls back by itself
when the new version fails, hangs or misses the latency objective."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.serving import (
    LoadReport,
    Replica,
    ReplicaState,
    RolloutPhase,
    RolloutSpec,
    ScalingSpec,
    desired_replicas,
    rollout_step,
)

SPEC = ScalingSpec(min_replicas=1, max_replicas=10, target_rps=100, latency_slo_ms=200)


def load(now: float, *rps: float, latency: float = 50.0) -> list[LoadReport]:
    return [LoadReport(f"r{i}", now, x, latency) for i, x in enumerate(rps)]


def test_it_grows_at_once_to_what_the_load_needs_and_stops_at_the_maximum() -> None:
    d = desired_replicas(SPEC, 2, load(100, 150, 160), now=100, last_change_at=99)
    assert d.replicas == 4 and "310 requests/s" in d.reason
    assert desired_replicas(SPEC, 9, load(100, 900, 900), 100, 99).replicas == 10
    # Latency over the objective with the load within target: one more.
    d = desired_replicas(SPEC, 3, load(100, 50, 50, latency=250), 100, 99)
    assert d.replicas == 4 and "latency" in d.reason
    assert desired_replicas(SPEC, 10, load(100, 50, latency=250), 100, 0).replicas == 10


def test_it_shrinks_only_after_a_quiet_window_to_what_its_peak_needed_with_headroom() -> None:
    quiet = [r for t in range(0, 301, 30) for r in load(t, 40, 40, 20)]
    # 100 requests/s for 5 minutes, but the last change was recent: no change.
    assert desired_replicas(SPEC, 4, quiet, now=300, last_change_at=100).replicas == 4
    # Quiet for the whole window: to what the peak needs at 80 % of the target each.
    d = desired_replicas(SPEC, 4, quiet, now=300, last_change_at=0)
    assert d.replicas == 2 and "peaked at 100" in d.reason
    # A peak inside the window holds the replicas it needed.
    peaked = quiet + load(150, 40, 40, 220)
    assert desired_replicas(SPEC, 4, peaked, now=300, last_change_at=0).replicas == 4
    # Latency above the objective anywhere in the window: no shrink.
    slow = quiet + load(200, 40, 40, 20, latency=300)
    assert desired_replicas(SPEC, 4, slow, now=300, last_change_at=0).replicas == 4
    # Nothing reported lately: no change either way.
    assert desired_replicas(SPEC, 4, quiet, now=1000, last_change_at=0).replicas == 4


def test_it_does_not_oscillate_at_the_edge_of_the_target() -> None:
    """Five replicas at 80 requests/s each (400 in all, four would do at 100 %): the count it
    would shrink to must have headroom, so it stays."""
    steady = [r for t in range(0, 301, 30) for r in load(t, 80, 80, 80, 80, 80)]
    assert desired_replicas(SPEC, 5, steady, now=300, last_change_at=0).replicas == 5


def test_latency_grows_it_once_per_change_and_only_live_replicas_count() -> None:
    # The same slow reports again after the count changed do not grow it again.
    reports = load(100, 50, 50, 50, latency=250)
    assert desired_replicas(SPEC, 3, reports, now=105, last_change_at=90).replicas == 4
    assert desired_replicas(SPEC, 4, reports, now=110, last_change_at=105).replicas == 4
    # Replicas gone since (they reported 40 each) are not summed with the ones that run.
    before = [LoadReport(f"g{i}", 95, 40, 50) for i in range(6)]
    now = load(100, 100, 100, 100, 100)
    live = {f"r{i}" for i in range(4)}
    assert desired_replicas(SPEC, 4, before + now, 100, 90, live=live).replicas == 4
    assert desired_replicas(SPEC, 4, before + now, 100, 90).replicas == 7


def test_hostile_reports_are_ignored_and_bad_specs_refused() -> None:
    bad = [
        LoadReport("r0", 100, float("nan"), 10),
        LoadReport("r1", 100, float("inf"), 10),
        LoadReport("r2", 100, -500, 10),
        LoadReport("r3", 100, 10, float("nan")),
        LoadReport("r4", 5000, 900, 10),  # from the future
    ]
    good = LoadReport("r5", 100, 500, 10)
    assert desired_replicas(SPEC, 2, [*bad, good], now=100, last_change_at=0).replicas == 5
    for kwargs in (
        {"min_replicas": 3, "max_replicas": 2},
        {"target_rps": 0},
        {"target_rps": float("nan")},
        {"latency_slo_ms": -1},
        {"scale_down_below": 0},
    ):
        fields = {"min_replicas": 1, "max_replicas": 4, "target_rps": 10, "latency_slo_ms": 100}
        with pytest.raises(ValueError):
            ScalingSpec(**{**fields, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RolloutSpec(max_surge=-1)


@settings(max_examples=300, deadline=None)
@given(
    current=st.integers(0, 12),
    rps=st.lists(st.floats(0, 2000), min_size=1, max_size=6),
    latency=st.floats(0, 1000),
    since=st.floats(0, 1000),
)
def test_the_count_stays_within_bounds_and_grows_to_what_the_load_needs(
    current: int, rps: list[float], latency: float, since: float
) -> None:
    reports = load(1000, *rps, latency=latency)
    d = desired_replicas(SPEC, current, reports, now=1000, last_change_at=1000 - since)
    assert SPEC.min_replicas <= d.replicas <= SPEC.max_replicas
    # As the decision counts: a load a hair above a multiple of the target (float noise in
    # the sum) does not need one more replica.
    need = max(math.ceil(sum(rps) / 100 - 1e-9), SPEC.min_replicas)
    here = min(max(current, SPEC.min_replicas), SPEC.max_replicas)
    if need >= here:
        assert d.replicas >= min(need, SPEC.max_replicas)  # grown to what the load needs
    else:
        # Never below the need; above the count only by one, for a fresh latency miss.
        slow = latency > SPEC.latency_slo_ms and since > 0
        assert min(need, SPEC.max_replicas) <= d.replicas <= here + (1 if slow else 0)


def step_world(replicas: list[Replica], step: object, now: float, seq: list[int]) -> list[Replica]:
    stop = set(step.stop)  # type: ignore[attr-defined]
    kept = [r for r in replicas if r.replica not in stop]
    for _ in range(step.start):  # type: ignore[attr-defined]
        seq[0] += 1
        kept.append(Replica(f"n{seq[0]}", step.version, ReplicaState.STARTING, now))  # type: ignore[attr-defined]
    return kept


@settings(max_examples=200, deadline=None)
@given(
    desired=st.integers(1, 6),
    surge=st.integers(0, 2),
    unavailable=st.integers(0, 2),
    ready_after=st.lists(st.integers(1, 3), min_size=1, max_size=5),
)
def test_a_rolling_update_stays_within_surge_and_unavailability_and_finishes(
    desired: int, surge: int, unavailable: int, ready_after: list[int]
) -> None:
    spec = RolloutSpec(max_surge=surge, max_unavailable=unavailable, ready_timeout_s=1e9)
    replicas = [Replica(f"o{i}", "v1", ReplicaState.READY, 0) for i in range(desired)]
    ceiling = desired + (surge if surge or unavailable else 1)
    seq = [0]
    for tick in range(1, 200):
        # Replicas starting for a while become ready (some take longer than others).
        replicas = [
            Replica(r.replica, r.version, ReplicaState.READY, tick)
            if r.state is ReplicaState.STARTING
            and tick - r.since >= ready_after[int(r.replica[1:]) % len(ready_after)]
            else r
            for r in replicas
        ]
        step = rollout_step(spec, desired, "v1", "v2", replicas, tick)
        assert step.phase is not RolloutPhase.ROLLING_BACK
        before_ready = sum(r.state is ReplicaState.READY for r in replicas)
        replicas = step_world(replicas, step, tick, seq)
        ready = sum(r.state is ReplicaState.READY for r in replicas)
        assert len(replicas) <= ceiling, (tick, replicas)
        assert ready >= min(desired - unavailable, before_ready), (tick, replicas)
        if step.phase is RolloutPhase.DONE:
            assert all(r.version == "v2" for r in replicas)
            assert len(replicas) == desired
            return
    raise AssertionError(f"the update never finished: {replicas}")


def test_a_failing_or_hanging_or_slow_new_version_is_rolled_back() -> None:
    spec = RolloutSpec(max_surge=1, ready_timeout_s=60, latency_slo_ms=200)
    old = [Replica(f"o{i}", "v1", ReplicaState.READY, 0, latency_ms=120) for i in range(3)]
    failed = [*old, Replica("n1", "v2", ReplicaState.FAILED, 10)]
    step = rollout_step(spec, 3, "v1", "v2", failed, 20)
    assert step.phase is RolloutPhase.ROLLING_BACK and "failed" in step.reason
    hanging = [*old, Replica("n1", "v2", ReplicaState.STARTING, 10)]
    assert rollout_step(spec, 3, "v1", "v2", hanging, 50).phase is RolloutPhase.ROLLING
    step = rollout_step(spec, 3, "v1", "v2", hanging, 100)
    assert step.phase is RolloutPhase.ROLLING_BACK and step.stop == ["n1"]
    slow = [*old, Replica("n1", "v2", ReplicaState.READY, 10, latency_ms=450)]
    step = rollout_step(spec, 3, "v1", "v2", slow, 20)
    assert step.phase is RolloutPhase.ROLLING_BACK and "450 ms" in step.reason
    # The way back is the same update the other way: it ends on v1 with the slow one gone.
    back = rollout_step(spec, 3, "v2", "v1", slow, 20)
    assert (back.phase, back.start, back.stop) == (RolloutPhase.ROLLING, 0, ["n1"])
    assert rollout_step(spec, 3, "v2", "v1", old, 21).phase is RolloutPhase.DONE


def test_a_finished_update_never_rolls_back_and_waiting_for_capacity_is_not_a_hang() -> None:
    spec = RolloutSpec(max_surge=1, ready_timeout_s=60, latency_slo_ms=200)
    # All on v2, slow under load, no v1 left to compare with: done, not rolled back.
    done = [Replica(f"n{i}", "v2", ReplicaState.READY, 0, latency_ms=400) for i in range(3)]
    assert rollout_step(spec, 3, "v1", "v2", done, 100).phase is RolloutPhase.DONE
    old = [Replica(f"o{i}", "v1", ReplicaState.READY, 0) for i in range(3)]
    # A new replica waiting to be placed for longer than the ready timeout is not hanging.
    pending = [*old, Replica("n1", "v2", ReplicaState.PENDING, 0)]
    assert rollout_step(spec, 3, "v1", "v2", pending, 1000).phase is RolloutPhase.ROLLING
    # No latency from ready old replicas: nothing to compare, no roll-back on latency.
    slow = [*old, Replica("n1", "v2", ReplicaState.READY, 0, latency_ms=900)]
    assert rollout_step(spec, 3, "v1", "v2", slow, 10).phase is RolloutPhase.ROLLING
    # A failure from an earlier attempt at the same version is not this update's.
    earlier = [*old, Replica("n0", "v2", ReplicaState.FAILED, 5)]
    assert rollout_step(spec, 3, "v1", "v2", earlier, 20, started_at=10).start == 1
    assert rollout_step(spec, 3, "v1", "v2", earlier, 20, started_at=0).phase is (
        RolloutPhase.ROLLING_BACK
    )
