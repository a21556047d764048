"""Fleet-level decisions: incidents, one alert per incident, cluster silence, recovery."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.health import SignalKind
from services.health.book import (
    Changes,
    Draft,
    HealthBook,
    heartbeats_seen,
    inventory_seen,
    probes_seen,
)
from services.health.machine import NodeState
from services.health.rules import HEARTBEAT_LOST
from tests.unit.health.builders import Fleet, at, beat, gang, probe, with_straggler

NODES = [f"a-{i}" for i in range(3)] + [f"b-{i}" for i in range(3)]

XID = SignalKind.GPU_XID


def test_a_critical_xid_quarantines_at_once_with_one_alert() -> None:
    f = Fleet()
    f.beats(0, "a-1")
    f.probes(1, probe("a-1", 1, XID, 79))
    assert f.state("a-1") == NodeState.UNHEALTHY
    assert f.unhealthy() == ["a-1"]
    [alert] = f.alerts()
    assert (alert.subject, alert.cause, alert.count, alert.node_id) == ("a-1", "xid_79", 1, "a-1")


def test_more_probes_on_a_quarantined_node_count_on_its_incident_without_alerts() -> None:
    f = Fleet()
    f.probes(1, probe("a-1", 1, XID, 79))
    for t in range(2, 12):
        f.probes(t, probe("a-1", t, XID, 79), probe("a-1", t, SignalKind.NVLINK_DOWN))
    assert len(f.alerts()) == 1 and f.unhealthy() == ["a-1"]
    [incident] = f.book.incidents.values()
    assert incident.count == 21


def test_an_unknown_xid_needs_three_in_its_window() -> None:
    f = Fleet()
    f.probes(1, probe("a-1", 1, XID, 13), probe("a-1", 2, XID, 31))
    assert f.state("a-1") == NodeState.HEALTHY and f.alerts() == []
    f.probes(3, probe("a-1", 3, XID, 43))
    [alert] = f.alerts()
    assert (alert.cause, alert.count) == ("xid_other", 3)


def test_a_probe_no_rule_matches_is_ignored() -> None:
    f = Fleet()
    f.probes(1, probe("a-1", 1, SignalKind.DISK_FULL))  # the test rules have no disk rule
    assert f.alerts() == [] and f.book.nodes["a-1"].recent == ()


def test_signals_about_nodes_no_inventory_lists_are_ignored_and_counted() -> None:
    f = Fleet()
    d = f._draft()
    heartbeats_seen(d, [beat("ghost-1", 1)])
    probes_seen(d, [probe("ghost-2", 1, XID, 79)], at(1))
    changes = f._apply(d)
    assert d.unknown_signals == 2
    assert changes.nodes == {} and f.book.nodes == {}
    # Never watched, so never dark: no incident, no alert however long it stays silent.
    f.check(600)
    assert f.alerts() == [] and f.book.nodes == {}


def test_a_flapping_node_is_quarantined_once_and_stays_out_while_it_flaps() -> None:
    f = Fleet()
    for t in range(0, 600, 5):  # throttles every 5 s for 10 minutes, heartbeats fine
        f.beats(t, "a-1")
        f.probes(t, probe("a-1", t))
        f.check(t)
    assert f.unhealthy() == ["a-1"] and len(f.alerts()) == 1 and f.recovered() == []
    # Then it calms down: back after the 120 s clean period, once.
    for t in range(600, 800, 5):
        f.beats(t, "a-1")
        f.check(t)
    assert f.recovered() == ["a-1"]
    assert next(r for c in f.log for r in c.recovered).at == at(715)  # last bad 595 + 120


def test_silence_makes_a_node_suspect_then_unhealthy_then_it_recovers() -> None:
    f = Fleet()
    f.beats(0, "a-1", "b-1")
    for t in range(5, 100, 5):
        f.beats(t, "b-1")  # b keeps its cluster from looking dark
        f.check(t)
        if t == 15:
            assert f.state("a-1") == NodeState.SUSPECT
    assert f.state("a-1") == NodeState.UNHEALTHY and f.unhealthy() == ["a-1"]
    [alert] = f.alerts()
    assert (alert.subject, alert.cause) == ("a-1", HEARTBEAT_LOST)
    for t in range(100, 220, 5):  # back after 100 s: the clean period counts from here
        f.beats(t, "a-1", "b-1")
        f.check(t)
    f.check(219)
    assert f.recovered() == []
    f.check(220)
    assert f.recovered() == ["a-1"] and f.state("a-1") == NodeState.HEALTHY
    assert f.book.incidents == {}


def test_a_whole_cluster_going_dark_raises_one_cluster_alert() -> None:
    f = Fleet()
    nodes = [f"gpu-{i}" for i in range(4)]
    f.beats(0, *nodes, "other-1")
    f.beats(3, "gpu-0")  # one node's last beat was a little later than the others'
    for t in range(5, 40):
        f.beats(t, "other-1")
        f.check(t)
    assert sorted(f.unhealthy()) == nodes
    [alert] = f.alerts()
    assert (alert.subject, alert.node_id, alert.cluster) == ("gpu", None, "gpu")
    [incident] = f.book.incidents.values()
    assert incident.count == 4
    # The cluster comes back; the incident closes with its last node.
    for t in range(40, 200, 5):
        f.beats(t, *nodes, "other-1")
        f.check(t)
    assert sorted(f.recovered()) == nodes and f.book.incidents == {}


def test_a_single_node_cluster_going_dark_is_a_node_alert() -> None:
    f = Fleet()
    f.beats(0, "solo-1")
    f.check(31)
    [alert] = f.alerts()
    assert alert.subject == "solo-1" and alert.node_id == "solo-1"


def test_nodes_listed_in_an_inventory_are_watched_even_without_heartbeats() -> None:
    from services.health.book import inventory_seen

    f = Fleet()
    d = f._draft()
    inventory_seen(d, "inv", ["inv-1", "inv-2"], at(0))
    f._apply(d)
    f.check(31)
    assert sorted(f.unhealthy()) == ["inv-1", "inv-2"] and len(f.alerts()) == 1


@settings(max_examples=150, deadline=None)
@given(
    bad=st.lists(st.floats(min_value=0, max_value=400), min_size=3, max_size=30),
    checks=st.lists(st.floats(min_value=0, max_value=800), min_size=1, max_size=60),
)
def test_a_node_is_never_recovered_before_its_clean_period(
    bad: list[float], checks: list[float]
) -> None:
    f = Fleet()
    events = sorted([(t, "probe") for t in bad] + [(t, "check") for t in checks])
    last_bad = None
    for t, what in events:
        f.beats(t, "a-1")  # always heartbeating: only the clean period holds it back
        if what == "probe":
            f.probes(t, probe("a-1", t, SignalKind.NVLINK_DOWN))
            last_bad = t
        else:
            changes = f.check(t)
            for r in changes.recovered:
                assert last_bad is not None
                assert (r.at - at(last_bad)).total_seconds() >= 120
                assert (r.at - r.node.quarantined_at).total_seconds() >= 60
    # One quarantine per incident: alerts and quarantines pair up, recoveries never exceed them.
    assert len(f.alerts()) == len(f.unhealthy()) >= len(f.recovered())


def test_a_node_its_inventory_stops_listing_is_no_longer_watched() -> None:
    """An elastic pool's node removed (or a Node object deleted) is gone, not silent: no
    heartbeat_lost for it. A quarantined one stays until it is back."""
    from services.health.book import inventory_seen

    f = Fleet()
    d = f._draft()
    inventory_seen(d, "pool", ["pool-0", "pool-1", "pool-2"], at(0))
    f._apply(d)
    f.beats(20, "pool-0", "pool-1")
    f.check(31)  # pool-2 silent past unhealthy_after_s: quarantined
    assert f.unhealthy() == ["pool-2"]
    d = f._draft()
    inventory_seen(d, "pool", ["pool-0"], at(32))
    changes = f._apply(d)
    assert changes.dropped == {"pool-1"}  # pool-2 is quarantined: kept
    assert sorted(f.book.nodes) == ["pool-0", "pool-2"]
    f.check(5000)
    assert "pool-1" not in f.unhealthy()  # gone, never declared lost
    assert "pool-0" in f.unhealthy()  # still listed and silent: lost


def test_a_cluster_incident_stays_open_until_its_last_node_is_back() -> None:
    f = Fleet()
    nodes = [f"gpu-{i}" for i in range(4)]
    f.beats(0, *nodes, "other-1")
    for t in range(5, 40):
        f.beats(t, "other-1")
        f.check(t)
    [incident] = f.book.incidents.values()
    for t in range(40, 200, 5):  # half the cluster is back first
        f.beats(t, "gpu-0", "gpu-1", "other-1")
        f.check(t)
    assert sorted(f.recovered()) == ["gpu-0", "gpu-1"]
    assert list(f.book.incidents) == [incident.incident_id]
    for t in range(200, 400, 5):
        f.beats(t, *nodes, "other-1")
        f.check(t)
    assert sorted(f.recovered()) == nodes and f.book.incidents == {}
    [closed] = [c.incidents[incident.incident_id] for c in f.log[-40:] if c.recovered]
    assert closed.closed_at is not None


def test_a_large_cluster_coming_back_costs_what_its_size_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each recovery looked for another member of the cluster incident among all nodes: the
    square of the cluster's size in node lookups when all of it came back."""
    lookups = 0
    original = Draft.node

    def counted(self: Draft, node_id: str) -> Any:
        nonlocal lookups
        lookups += 1
        return original(self, node_id)

    monkeypatch.setattr(Draft, "node", counted)
    f = Fleet()
    nodes = [f"big-{i}" for i in range(300)]
    f.beats(0, *nodes, "other-1")
    for t in range(5, 40, 5):
        f.beats(t, "other-1")
        f.check(t)
    assert len(f.unhealthy()) == len(nodes)
    most = 0
    for t in range(40, 400, 5):
        f.beats(t, *nodes, "other-1")
        lookups = 0
        f.check(t)
        most = max(most, lookups)
    assert sorted(f.recovered()) == sorted(nodes) and f.book.incidents == {}
    assert most < 20 * len(nodes)


class _EveryNode(HealthBook):
    """A book whose clock pass looks at every node, as before the pass kept an index."""

    def quiet(self, heard_by: datetime) -> set[str]:
        return set(self.nodes)

    def stale_tracks(self, by: datetime) -> set[str]:
        return set(self.tracks)

    def apply(self, changes: Changes) -> None:
        super().apply(changes)
        self.quarantined = set(self.nodes)


CLOCK_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("beats"), st.sets(st.sampled_from(NODES), min_size=1)),
        st.tuples(st.just("probe"), st.sets(st.sampled_from(NODES), min_size=1)),
        st.tuples(st.just("check"), st.sets(st.just("")), st.integers(-20, 40)),
        # Cluster a's inventory lists only these nodes now: the others are dropped.
        st.tuples(st.just("inventory"), st.sets(st.sampled_from(NODES[:3]))),
        # A gang on two or three nodes of cluster a: one replica twice as slow, or none (-1).
        st.tuples(
            st.just("progress"),
            st.sampled_from(["j1", "j2"]),
            st.integers(-1, 2),
            st.sampled_from([NODES[:3], NODES[:2], NODES[1:3]]),
        ),
    ),
    max_size=50,
)


@settings(max_examples=250, deadline=None)
@given(CLOCK_STEPS, st.integers(0, 60))
def test_the_clock_pass_decides_what_a_look_at_every_node_decides(
    steps: list[tuple[Any, ...]], watch_from: int
) -> None:
    """Silences, cluster incidents, recoveries and stragglers' reports expiring, with
    heartbeats, quarantining probes, progress reports and a clock that may go back: the pass
    over the indexes changes what a pass over every node and track changes, in order."""
    rules = with_straggler(n=1, m=2, expire_after_s=20, quarantine=True)
    indexed = Fleet(rules=rules, watch_from=watch_from)
    every = Fleet(rules=rules, watch_from=watch_from)
    every.book = _EveryNode()
    t = 0.0
    for step in steps:
        t += 5
        for f in (indexed, every):
            if step[0] == "beats":
                f.beats(t, *sorted(step[1]))
            elif step[0] == "probe":
                f.probes(t, *(probe(n, t, SignalKind.GPU_XID, xid=79) for n in sorted(step[1])))
            elif step[0] == "inventory":
                d = f._draft()
                inventory_seen(d, "a", sorted(step[1]), at(t))
                f._apply(d)
            elif step[0] == "progress":
                on = step[3]
                times = [2.0 if i == step[2] else 1.0 for i in range(len(on))]
                f.progress(t, gang(step[1], t, *times, nodes=on, cluster="a"))
            else:
                f.check(t + step[2])
    assert indexed.log == every.log
    assert indexed.book.nodes == every.book.nodes
    assert indexed.book.tracks == every.book.tracks
    # The heaps hold about an entry per node and track, whatever the traffic.
    book = indexed.book
    assert len(book._heard) <= 2 * max(1, len(book.nodes)) + len(NODES)
    assert len(book._oldest) <= 2 * max(1, len(book.tracks)) + 2


def test_a_clock_set_back_loses_no_silent_node() -> None:
    f = Fleet()
    f.beats(0, "a-0", "a-1", "b-0")
    f.beats(1, "b-0")
    f.check(20)  # a-0 and a-1 quiet for 20 s: suspect
    assert f.state("a-0") == NodeState.SUSPECT
    f.check(10)  # the clock went back: nobody is quiet long enough now
    for t in (15, 20, 25, 30):
        f.beats(t, "b-0")
    f.check(40)  # the clock is right again: still not heard, so out
    assert sorted(f.unhealthy()) == ["a-0", "a-1"]


def test_the_heartbeat_heap_holds_an_entry_a_node_whatever_the_traffic() -> None:
    """Each heartbeat used to add an entry, each leaving only once older than the silence
    threshold: the heap grew with heartbeats per node, not with nodes."""
    f = Fleet()
    nodes = [f"a-{i}" for i in range(10)]
    for t in range(0, 300):
        f.beats(t, *nodes)
        if t % 5 == 0:
            f.check(t)
    assert f.recovered() == [] and f.unhealthy() == []
    assert len(f.book._heard) <= len(nodes) + 1
