"""The straggler detector alone: pace against the median of the other replicas, n-of-m windows,
the end of a straggle, ignored reports, new attempts and expiry."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.health.pace import (
    ReplicaStep,
    Track,
    _median_without,
    expire,
    observe,
    paces,
)
from services.health.rules import StragglerRules
from tests.unit.health.builders import at, gang

RULES = StragglerRules()  # slowdown 1.5, 3 of the last 5, expire after 60 s


def steps(*times: float) -> list[ReplicaStep]:
    return [ReplicaStep(i, f"g-{i}", s) for i, s in enumerate(times)]


def slow_nodes(*times: float, slowdown: float = 1.5) -> dict[str, float]:
    return {p.node_id: round(p.ratio, 3) for p in paces(steps(*times), slowdown) if p.slow}


@pytest.mark.parametrize(
    ("times", "slow"),
    [
        # Against the median of the *others*: 3.0 / median(1.0, 1.0, 1.1).
        ((1.0, 1.0, 3.0, 1.1), {"g-2": 3.0}),
        # An even number of others: 9 / median(1, 1, 2, 2) = 9 / 1.5.
        ((1.0, 1.0, 2.0, 2.0, 9.0), {"g-4": 6.0}),
        # Two replicas: each against the other; the faster one is never slow.
        ((1.0, 3.0), {"g-1": 3.0}),
        ((1.0, 1.5), {}),  # exactly the slowdown is not above it
        ((1.0, 1.51), {"g-1": 1.51}),
        # A uniformly slow gang has no straggler: the peers are slow too.
        ((3.0, 3.1, 2.9, 3.0), {}),
        # Two slow of four: the median of each one's peers (1, 1, 4) is still fast.
        ((1.0, 1.0, 4.0, 4.0), {"g-2": 4.0, "g-3": 4.0}),
        # Most of the gang slow: the slow ones are the peers, the fast one is not slow.
        ((1.0, 4.0, 4.0, 4.0), {}),
    ],
)
def test_a_replica_is_slow_above_slowdown_times_the_median_of_its_peers(
    times: tuple[float, ...], slow: dict[str, float]
) -> None:
    assert slow_nodes(*times) == slow


def test_a_node_paces_as_its_slowest_replica() -> None:
    replicas = [
        ReplicaStep(0, "a", 1.0),
        ReplicaStep(1, "a", 2.0),
        ReplicaStep(2, "b", 1.0),
        ReplicaStep(3, "b", 1.0),
    ]
    by_node = {p.node_id: p for p in paces(replicas, 1.5)}
    assert (by_node["a"].replica, by_node["a"].ratio, by_node["a"].slow) == (1, 2.0, True)
    assert not by_node["b"].slow


@given(st.lists(st.floats(min_value=0.01, max_value=1e4), min_size=2, max_size=40), st.data())
def test_the_median_without_one_equals_the_plain_median_of_the_rest(
    times: list[float], data: st.DataObject
) -> None:
    i = data.draw(st.integers(0, len(times) - 1))
    rest = times[:i] + times[i + 1 :]
    assert _median_without(sorted(times), times[i]) == pytest.approx(statistics.median(rest))


def run(pattern: str, rules: StragglerRules = RULES) -> tuple[Track, list[str]]:
    """Feed reports where g-2 is slow ("S") or not ("."); returns the track and what happened
    at each report: "start", "again", "end" or ""."""
    track: Track | None = None
    what: list[str] = []
    for t, c in enumerate(pattern):
        seen = observe(track, gang("j", t, 1.0, 1.0, 3.0 if c == "S" else 1.05), rules)
        assert seen is not None
        track = seen.track
        what.append(
            "start" if seen.started else "again" if seen.slow_again else "end" if seen.ended else ""
        )
    assert track is not None
    return track, what


@pytest.mark.parametrize(
    ("pattern", "starts_at"),
    [
        ("SSS", 2),  # 3 of the first 3
        ("SS.S", 3),  # 3 of the last 4
        ("S..SS", 4),  # 3 of the last 5
        ("S...SS", None),  # the first one left the window
        ("S.S..S.S..S.S", None),  # 2 of every 5: noise, never 3 of 5
        ("SS", None),
    ],
)
def test_a_node_straggles_once_slow_in_n_of_the_last_m_reports(
    pattern: str, starts_at: int | None
) -> None:
    track, what = run(pattern)
    assert (what.index("start") if "start" in what else None) == starts_at
    assert track.straggling("g-2") == (starts_at is not None)
    assert not track.straggling("g-0")


def test_a_straggle_starts_once_and_ends_after_m_reports_in_a_row_not_slow() -> None:
    track, what = run("SSS" + "S" * 5 + "...." + "S" + "....." + "SSS")
    assert what.count("start") == 2  # the first straggle, and the one after it ended
    assert what[3:8] == ["again"] * 5
    assert what[8:12] == ["", "", "", ""]  # 4 good reports: not yet
    assert what[12] == "again"  # slow again before m good ones: the same straggle
    assert what[13:18] == ["", "", "", "", "end"]  # the 5th good one in a row ends it
    assert what[18:] == ["", "", "start"]  # a new straggle needs n slow reports again
    assert track.straggling("g-2")


def test_a_start_names_the_replica_its_ratio_and_the_slow_reports() -> None:
    seen = None
    track = None
    for t in range(3):
        seen = observe(track, gang("j", t, 1.0, 3.0, 1.0, 1.0), RULES)
        assert seen is not None
        track = seen.track
    assert seen is not None
    [s] = seen.started
    assert (s.node_id, s.job_id, s.replica, s.ratio, s.slow_reports, s.at) == (
        "g-1",
        "j",
        1,
        3.0,
        3,
        at(2),
    )
    assert "3.0x" in s.label() and "3 of the last 5" in s.label()


def test_m_one_n_one_follows_every_report() -> None:
    _, what = run("S.S", StragglerRules(n=1, m=1))
    assert what == ["start", "end", "start"]


def test_gangs_of_one_older_attempts_and_redeliveries_are_ignored() -> None:
    assert observe(None, gang("j", 0, 5.0), RULES) is None
    first = observe(None, gang("j", 10, 1.0, 3.0, attempt=2), RULES)
    assert first is not None
    track = first.track
    assert observe(track, gang("j", 10, 1.0, 3.0, attempt=2), RULES) is None  # same time
    assert observe(track, gang("j", 9, 1.0, 3.0, attempt=2), RULES) is None  # older
    assert observe(track, gang("j", 11, 1.0, 3.0, attempt=1), RULES) is None  # older run
    assert observe(track, gang("j", 11, 1.0, 3.0, attempt=2), RULES) is not None


def test_a_new_attempt_lets_go_of_nodes_it_left_and_keeps_the_history_of_those_it_kept() -> None:
    track, _ = run("SSS")  # g-2 straggles on attempt 1
    moved = observe(
        track, gang("j", 10, 1.0, 1.0, 3.0, nodes=["g-0", "g-1", "h-9"], attempt=2), RULES
    )
    assert moved is not None
    assert moved.ended == ("g-2",) and moved.track.window("g-2") is None
    assert moved.track.window("h-9") is not None and not moved.started  # 1 slow report only
    kept = observe(track, gang("j", 10, 1.0, 1.0, 3.0, attempt=2), RULES)
    assert kept is not None and kept.ended == () and kept.slow_again == ("g-2",)


def test_windows_expire_when_reports_stop_counted_from_watch_from_at_the_earliest() -> None:
    track, _ = run("SSS")  # last report at t=2
    same, ended = expire(track, at(61), at(0), RULES)
    assert same is track and ended == ()
    gone, ended = expire(track, at(62), at(0), RULES)
    assert gone is None and ended == ("g-2",)
    # A service that started (watch_from) at 30 gives the job until 90.
    same, _ = expire(track, at(89), at(30), RULES)
    assert same is track
    gone, _ = expire(track, at(90), at(30), RULES)
    assert gone is None
