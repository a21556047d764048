"""Straggler incidents over the book: one alert per incident (never per report), noise that
never alerts, the end of an incident and a later one, one incident per node across jobs,
expiry when reports stop, and the optional quarantine."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.health import Severity, SignalKind
from services.health.book import Draft
from services.health.machine import NodeState
from services.health.rules import STRAGGLER
from tests.unit.health.builders import Fleet, at, gang, probe, with_straggler

SLOW = (1.0, 1.0, 3.0, 1.0)  # g-2 runs 3x slower than its peers
FINE = (1.0, 1.02, 0.98, 1.0)


def stragglers(f: Fleet) -> list[str]:
    return [i.subject for i in f.alerts() if i.cause == STRAGGLER]


def open_straggler_incidents(f: Fleet) -> list[str]:
    return sorted(i.subject for i in f.book.incidents.values() if i.cause == STRAGGLER)


def test_a_replica_three_times_slower_raises_one_alert_however_long_it_stays_slow() -> None:
    f = Fleet(rules=with_straggler())
    f.reports("job-1", [0, 2], *SLOW)
    assert f.alerts() == []  # 2 of 5: not yet
    f.reports("job-1", range(4, 200, 2), *SLOW)
    [alert] = f.alerts()
    assert (alert.subject, alert.node_id, alert.cluster) == ("g-2", "g-2", "g")
    assert (alert.cause, alert.severity, alert.count) == (STRAGGLER, Severity.WARNING, 3)
    assert alert.suggested_action.startswith("Node g-2 runs job job-1's replica 2 3.0x slower")
    assert f.unhealthy() == [] and "g-2" not in f.book.nodes  # quarantine is off by default
    [incident] = f.book.incidents.values()
    assert incident.count == 100 and incident.last_seen == at(198)  # every slow report counted


def test_a_two_replica_gang_names_the_slow_one() -> None:
    f = Fleet(rules=with_straggler())
    f.reports("job-1", range(0, 10, 2), 1.0, 2.0)
    assert stragglers(f) == ["g-1"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(min_value=1.0, max_value=1.4), min_size=2, max_size=8),
        min_size=1,
        max_size=30,
    )
)
def test_noise_below_the_slowdown_never_alerts(reports: list[list[float]]) -> None:
    f = Fleet(rules=with_straggler())
    for t, times in enumerate(reports):
        f.progress(t, gang("job-1", t, *times))
    assert f.alerts() == [] and open_straggler_incidents(f) == []


def test_spikes_in_fewer_than_n_of_m_reports_do_not_alert() -> None:
    f = Fleet(rules=with_straggler())
    for t in range(40):  # slow in 2 of every 5 reports
        f.progress(t, gang("job-1", t, *(SLOW if t % 5 in (0, 2) else FINE)))
    assert f.alerts() == []


def test_an_incident_ends_after_m_reports_not_slow_and_a_later_one_alerts_again() -> None:
    f = Fleet(rules=with_straggler())
    f.reports("job-1", range(0, 5), *SLOW)
    f.reports("job-1", range(5, 9), *FINE)
    assert open_straggler_incidents(f) == ["g-2"]  # 4 good reports: still the same incident
    f.reports("job-1", [9], *FINE)
    assert open_straggler_incidents(f) == []
    closed = next(i for c in f.log for i in c.incidents.values() if i.closed_at is not None)
    assert closed.closed_at == at(9)
    f.reports("job-1", range(10, 13), *SLOW)
    assert stragglers(f) == ["g-2", "g-2"]
    assert len({i.incident_id for i in f.alerts()}) == 2


def test_a_redelivered_report_is_not_counted_again() -> None:
    f = Fleet(rules=with_straggler())
    for _ in range(3):  # the same report three times: one slow verdict
        f.progress(5, gang("job-1", 0, *SLOW))
    assert f.alerts() == []
    [track] = f.book.tracks.values()
    assert track.window("g-2").recent == (True,)  # type: ignore[union-attr]


def test_two_jobs_slow_on_the_same_node_share_one_incident_until_both_recover() -> None:
    f = Fleet(rules=with_straggler())
    f.reports("job-1", range(0, 3), *SLOW)
    f.reports("job-2", range(0, 3), 2.0, 6.0, nodes=["h-1", "g-2"])
    assert stragglers(f) == ["g-2"]
    f.reports("job-1", range(3, 8), *FINE)  # job-1 no longer finds it slow ...
    assert open_straggler_incidents(f) == ["g-2"]  # ... but job-2 still does
    f.reports("job-2", range(3, 8), 2.0, 2.0, nodes=["h-1", "g-2"])
    assert open_straggler_incidents(f) == []
    assert len(f.alerts()) == 1


def test_when_the_job_ends_its_reports_stop_and_the_incident_expires() -> None:
    f = Fleet(rules=with_straggler(expire_after_s=60))
    f.reports("job-1", range(0, 3), *SLOW)
    f.check(61)
    assert open_straggler_incidents(f) == ["g-2"] and "job-1" in f.book.tracks
    f.check(62)  # 60 s after the last report
    assert open_straggler_incidents(f) == [] and f.book.tracks == {}
    f.reports("job-2", range(100, 103), *SLOW)  # the next job on the slow node: a new alert
    assert stragglers(f) == ["g-2", "g-2"]


def test_quarantine_takes_the_node_out_once_and_recovery_ends_the_incident() -> None:
    f = Fleet(rules=with_straggler(quarantine=True, clean_period_s=30))
    f.beats(0, "g-2")
    f.reports("job-1", range(0, 10), *SLOW)
    assert f.unhealthy() == ["g-2"] and stragglers(f) == ["g-2"]
    assert f.state("g-2") == NodeState.UNHEALTHY and f.book.nodes["g-2"].cause == STRAGGLER
    [sick] = [u for c in f.log for u in c.unhealthy]
    assert sick.node.incident_id == f.alerts()[0].incident_id
    assert sick.signals[0].startswith("job job-1 replica 2 3.0x slower")
    assert f.book.nodes["g-2"].last_bad_at == at(9)  # every slow report holds it out
    # The job is stopped there: reports stop and expire, but the quarantine's incident stays
    # open until the node recovers (60 s minimum quarantine, 30 s clean, heartbeating).
    for t in range(10, 200, 5):
        f.beats(t, "g-2")
        f.check(t)
    assert f.recovered() == ["g-2"] and f.book.incidents == {} and f.book.tracks == {}
    assert len(f.alerts()) == 1


def test_a_node_already_quarantined_for_another_cause_raises_no_straggler_alert() -> None:
    f = Fleet(rules=with_straggler())
    f.probes(0, probe("g-2", 0, SignalKind.GPU_XID, 79))
    f.reports("job-1", range(1, 10), *SLOW)
    assert [i.cause for i in f.alerts()] == ["xid_79"]
    assert f.book.incidents[f.alerts()[0].incident_id].count == 1  # not counted on the XID


def test_the_slowdown_n_and_m_come_from_the_rules() -> None:
    f = Fleet(rules=with_straggler(slowdown=4.0))
    f.reports("job-1", range(10), *SLOW)  # 3x is below a 4x slowdown
    assert f.alerts() == []
    f = Fleet(rules=with_straggler(n=2, m=2))
    f.reports("job-1", range(2), *SLOW)
    assert stragglers(f) == ["g-2"]


JOBS = st.sampled_from(["job-1", "job-2", "job-3"])
STEP = st.one_of(
    # One batch of progress reports: each job's replica `k` three times slower (-1: none).
    st.tuples(st.just("progress"), st.lists(st.tuples(JOBS, st.integers(-1, 3)), min_size=1)),
    st.tuples(st.just("beats"), st.integers(0, 3)),
    st.tuples(st.just("probe"), st.integers(0, 3)),
    st.tuples(st.just("quiet"), st.integers(1, 4)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=40), st.booleans())
def test_the_kept_counts_equal_a_recount_of_the_book(
    steps: list[tuple[str, Any]], quarantine: bool
) -> None:
    """Nodes by state and the jobs each node straggles on are kept as changes apply; whatever
    happens, they are what counting the book afresh gives. And a node's straggler incident
    ends only when no job's track still finds it slow."""
    # One slow report makes a straggler, two fine ones in a row end it: steps matter fast.
    f = Fleet(rules=with_straggler(n=1, m=2, quarantine=quarantine, expire_after_s=20))
    t = 0.0
    for kind, arg in steps:
        t += 2
        if kind == "progress":
            f.progress(
                t,
                *(gang(job, t, *(3.0 if i == k else 1.0 for i in range(4))) for job, k in arg),
            )
        elif kind == "beats":
            f.beats(t, *(f"g-{i}" for i in range(4) if i != arg))
        elif kind == "probe":
            f.probes(t, probe(f"g-{arg}", t, SignalKind.GPU_XID, xid=79))
        else:  # the clock runs on: silences, recoveries, reports expiring
            for _ in range(arg):
                t += 15
                f.check(t)
        kept = (dict(f.book.by_state), {n: set(j) for n, j in f.book.straggling_on.items()})
        f.book.recount()
        assert {s: n for s, n in kept[0].items() if n} == dict(f.book.by_state)
        assert kept[1] == f.book.straggling_on
        for node in (f"g-{i}" for i in range(4)):
            slow = any(tr.straggling(node) for tr in f.book.tracks.values())
            assert (node in f.book.straggling_on) == slow
            inc = [
                i for i in f.book.incidents.values() if i.cause == STRAGGLER and i.node_id == node
            ]
            held = f.book.nodes.get(node)
            found = Draft(f.book, f.rules, lambda: "x").straggler_incident(node)
            assert found == (min(inc, key=lambda i: i.incident_id) if inc else None)
            if inc and not slow:  # only a quarantine's incident outlives the slowness
                assert held is not None and held.incident_id == inc[0].incident_id
            if slow and not inc:  # no incident while slow: out for another cause already
                assert held is not None and held.state == NodeState.UNHEALTHY
