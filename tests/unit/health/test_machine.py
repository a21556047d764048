"""One node's state machine: table-driven edges and Hypothesis invariants."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.health import machine
from services.health.machine import NodeHealth, NodeState, Signal, Verdict
from services.health.rules import HEARTBEAT_LOST
from tests.unit.health.builders import RULES, TIMINGS, at

THERMAL = RULES.by_name("thermal")
XID79 = RULES.by_name("xid_79")
assert THERMAL is not None and XID79 is not None


def node(**fields: object) -> NodeHealth:
    return replace(NodeHealth("a-1", "a", last_heard=at(0)), **fields)  # type: ignore[arg-type]


def sick(cause: str = "thermal", quarantined: float = 0, bad: float = 0, heard: float = 0):  # type: ignore[no-untyped-def]
    return node(
        state=NodeState.UNHEALTHY,
        cause=cause,
        incident_id="inc",
        quarantined_at=at(quarantined),
        last_bad_at=at(bad),
        last_heard=at(heard),
    )


@pytest.mark.parametrize(
    ("last_heard", "state", "now", "expected_state", "verdict"),
    [
        (0, NodeState.HEALTHY, 10, NodeState.HEALTHY, Verdict.NONE),
        (0, NodeState.HEALTHY, 15, NodeState.SUSPECT, Verdict.NONE),
        (0, NodeState.SUSPECT, 29, NodeState.SUSPECT, Verdict.NONE),
        (0, NodeState.SUSPECT, 30, NodeState.UNHEALTHY, Verdict.QUARANTINE),
        (0, NodeState.HEALTHY, 31, NodeState.UNHEALTHY, Verdict.QUARANTINE),
        (None, NodeState.HEALTHY, 31, NodeState.UNHEALTHY, Verdict.QUARANTINE),
    ],
)
def test_silence_goes_suspect_then_unhealthy(
    last_heard: float | None,
    state: NodeState,
    now: float,
    expected_state: NodeState,
    verdict: Verdict,
) -> None:
    n = node(last_heard=None if last_heard is None else at(last_heard), state=state)
    after, got = machine.silence(n, at(now), at(0), TIMINGS)
    assert (after.state, got) == (expected_state, verdict)
    if verdict == Verdict.QUARANTINE:
        assert after.cause == HEARTBEAT_LOST and after.quarantined_at == at(now)


def test_a_restarted_service_counts_silence_from_its_own_start() -> None:
    # The node's last heartbeat is an hour old only because the service was down.
    n = node(last_heard=at(0))
    after, verdict = machine.silence(n, at(3600 + 20), at(3600), TIMINGS)
    assert (after.state, verdict) == (NodeState.SUSPECT, Verdict.NONE)


@pytest.mark.parametrize(
    ("state", "expected"),
    [(NodeState.SUSPECT, NodeState.HEALTHY), (NodeState.HEALTHY, NodeState.HEALTHY)],
)
def test_a_heartbeat_clears_suspicion(state: NodeState, expected: NodeState) -> None:
    assert machine.heartbeat(node(state=state), at(5), TIMINGS).state == expected


def test_an_old_heartbeat_changes_nothing() -> None:
    n = node(last_heard=at(10), state=NodeState.SUSPECT)
    assert machine.heartbeat(n, at(5), TIMINGS) == n


def test_heartbeats_resuming_after_silence_restart_the_clean_period() -> None:
    n = sick(cause=HEARTBEAT_LOST, quarantined=30, bad=30, heard=0)
    after = machine.heartbeat(n, at(100), TIMINGS)
    assert after.last_bad_at == at(100) and after.state == NodeState.UNHEALTHY


def test_a_critical_signal_quarantines_at_once() -> None:
    after, verdict, behind = machine.probe(node(), XID79, Signal("xid_79", at(1), "x"), at(2))
    assert (after.state, after.cause, verdict, len(behind)) == (
        NodeState.UNHEALTHY,
        "xid_79",
        Verdict.QUARANTINE,
        1,
    )


@pytest.mark.parametrize(
    ("times", "quarantined"),
    [
        ((0, 10), False),  # two of three
        ((0, 10, 20), True),  # three within 60 s
        ((0, 30, 61), False),  # the first fell out of the window
        ((0, 30, 61, 70), True),  # 30, 61, 70 are within 60 s
        ((0, 59.9, 59.95), True),
    ],
)
def test_transient_signals_need_n_within_the_window(
    times: tuple[float, ...], quarantined: bool
) -> None:
    n = node()
    verdicts = []
    for t in times:
        n, v, _ = machine.probe(n, THERMAL, Signal("thermal", at(t), str(t)), at(t))
        verdicts.append(v)
    assert (Verdict.QUARANTINE in verdicts) == quarantined
    assert (n.state == NodeState.UNHEALTHY) == quarantined


def test_a_signal_on_a_quarantined_node_is_counted_and_pushes_the_clean_period() -> None:
    after, verdict, _ = machine.probe(sick(bad=0), THERMAL, Signal("thermal", at(50), ""), at(50))
    assert verdict == Verdict.COUNTED and after.last_bad_at == at(50)


@pytest.mark.parametrize(
    ("quarantined", "bad", "heard", "now", "ok"),
    [
        (0, 0, 119, 120, True),  # clean 120 s, served 60 s, heard 1 s ago
        (0, 0, 119, 119, False),  # clean period not over
        (0, 0, 100, 120, False),  # heartbeats stale (20 s > suspect 15 s)
        (100, 0, 179, 150, False),  # min quarantine not served
        (0, 50, 169, 169, False),  # a late bad signal restarted the clean period
        (0, 50, 169, 170, True),
    ],
)
def test_recovery_needs_quarantine_served_a_clean_period_and_fresh_heartbeats(
    quarantined: float, bad: float, heard: float, now: float, ok: bool
) -> None:
    n = sick(quarantined=quarantined, bad=bad, heard=heard)
    assert machine.recoverable(n, at(now), RULES) is ok


def test_recovery_resets_the_node() -> None:
    back = machine.recover(sick())
    assert back == node(last_heard=at(0))


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.floats(min_value=30.01, max_value=500), min_size=1, max_size=40))
def test_a_signal_flapping_under_the_threshold_never_quarantines(gaps: list[float]) -> None:
    # Three in 60 s quarantines; more than 30 s apart, no 60 s holds three.
    n, t = node(), 0.0
    for gap in gaps:
        t += gap
        n, verdict, _ = machine.probe(n, THERMAL, Signal("thermal", at(t), ""), at(t))
        assert verdict == Verdict.NONE
    assert n.state == NodeState.HEALTHY
    assert len(n.recent) <= THERMAL.threshold - 1
