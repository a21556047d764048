"""Elastic pools on Kubernetes (services/executor/kube/provisioning.py): what is on its way is
read from the cluster (open requests less the nodes matched to them, a node marked with the
request it came for), so the same decision never asks twice and overlapping requests never
buy more than the size; a request that fails or is not provisioned in time loses its nodes;
only unprovisioned requests are canceled."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.kube.provisioning import (
    Machine,
    Request,
    match,
    parse_machine,
    parse_request,
    plan,
    request_name,
)

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def req(name: str, count: int, s: float, pool: str = "p", **kw: object) -> Request:
    return Request(name, pool, count, at(s), at(s), **kw)  # type: ignore[arg-type]


def node(name: str, s: float, pool: str = "p", **kw: object) -> Machine:
    options = {"ready": True, "kept": True, "released": False, **kw}
    return Machine(name, pool, at(s), **options)  # type: ignore[arg-type]


NOW = at(1000)


def test_missing_nodes_are_asked_once_and_what_is_coming_counts() -> None:
    assert plan({"p": 3}, [], [], NOW).ask == {"p": 3}
    coming = [req("r1", 2, 0)]
    assert plan({"p": 3}, coming, [node("a", -10)], NOW).ask == {}
    # Two of them came: nothing is missing, the met request goes, its nodes get marked.
    joined = [node("a", -10), node("b", 5), node("c", 6)]
    steps = plan({"p": 3}, [req("r1", 2, 0, provisioned=True)], joined, NOW)
    assert steps.ask == {} and [r.name for r in steps.done] == ["r1"]
    assert steps.waiting == {} and steps.mark == {"b": "r1", "c": "r1"}


def test_a_node_counts_for_the_request_it_is_marked_with_or_the_oldest_made_before_it() -> None:
    requests = [req("r1", 1, 0), req("r2", 2, 10)]
    assert match(requests, [node("a", 5), node("b", 11), node("c", 12)]) == {
        "a": "r1",
        "b": "r2",
        "c": "r2",
    }
    # A node of the same second as a request does not count for it.
    assert match([req("r", 1, 7)], [node("a", 7)]) == {}
    # A node marked for a request that is over counts for no other.
    assert match([req("r2", 2, 0)], [node("a", 5, request="r1")]) == {}


def test_overlapping_requests_never_buy_more_than_the_size() -> None:
    """desired 2 asks r1; desired 4 asks r2 before r1's nodes come; r1's nodes come, are
    marked for it, and r1 goes: they must not then count for r2 (which would ask r3)."""
    r1, r2 = req("r1", 2, 0, provisioned=True), req("r2", 2, 3)
    joined = [node("a", 10, kept=False), node("b", 10, kept=False)]
    first = plan({"p": 4}, [r1, r2], joined, NOW)
    assert first.ask == {} and [r.name for r in first.done] == ["r1"]
    assert first.mark == {"a": "r1", "b": "r1"} and first.waiting == {"r2": 2}
    marked = [replace(m, kept=True, request="r1") for m in joined]
    second = plan({"p": 4}, [r2], marked, NOW)
    assert second.ask == {} and second.waiting == {"r2": 2}


def test_beyond_the_size_newest_unprovisioned_requests_go_but_none_newer_than_the_inventory() -> (
    None
):
    requests = [req("r1", 1, 0, provisioned=True), req("r2", 1, 10), req("r3", 2, 20)]
    steps = plan({"p": 1}, requests, [], NOW)
    assert [r.name for r in steps.cancel] == ["r3", "r2"]
    # A request made after the decision's inventory was not known to it: it stays.
    steps = plan({"p": 1}, requests, [], NOW, since={"p": at(15)})
    assert [r.name for r in steps.cancel] == ["r2"]


def test_a_failed_or_late_request_loses_its_nodes_and_a_quiet_pool_asks_nothing() -> None:
    failed = [req("r1", 2, 0, failed="quota")]
    steps = plan({"p": 2}, failed, [], NOW, quiet={"p"})
    assert [r.name for r in steps.done] == ["r1"] and steps.failures["p"][1] == 2
    assert steps.ask == {}
    # Not in the round it failed either (the size drops first); afterwards, if not quiet.
    assert plan({"p": 2}, failed, [], NOW).ask == {}
    assert plan({"p": 2}, [], [], NOW).ask == {"p": 2}
    # cluster-autoscaler keeps retrying a stockout: past the timeout the request has failed.
    stuck = [req("r1", 2, 0, waiting_why="stockout")]
    assert plan({"p": 2}, stuck, [], at(100), timeout_s={"p": 300}).failures == {}
    (r, lost) = plan({"p": 2}, stuck, [], at(400), timeout_s={"p": 300}).failures["p"]
    assert lost == 2 and "stockout" in (r.failed or "")


def test_capacity_found_brings_no_node_and_released_nodes_are_not_the_pools() -> None:
    steps = plan({"p": 1}, [req("r1", 1, 0, provisioned=True, found=True)], [], NOW)
    assert [r.name for r in steps.done] == ["r1"] and steps.waiting == {}
    machines = [node("a", 0, released=True, kept=False), node("b", 0, kept=False)]
    steps = plan({"p": 2}, [], machines, NOW)
    assert steps.ask == {"p": 1}
    assert steps.mark == {"b": None}


def test_the_clusters_objects_parse_and_names_are_valid() -> None:
    obj = {
        "metadata": {
            "name": "qm-x",
            "labels": {"quartermaster.io/pool": "p"},
            "annotations": {"quartermaster.io/requested-at": "2026-11-25T12:00:00.250000+00:00"},
            "creationTimestamp": "2026-11-25T12:00:01Z",
        },
        "spec": {"podSets": [{"count": 2}, {"count": 1}]},
        "status": {
            "conditions": [
                {"type": "Provisioned", "status": "True", "reason": "Provisioned"},
                {"type": "Failed", "status": "False"},
            ]
        },
    }
    r = parse_request(obj)
    assert r is not None and (r.count, r.provisioned, r.found, r.failed) == (3, True, False, None)
    assert r.created_at == at(1) and r.requested_at == at(0.25)
    assert parse_request({"metadata": {"name": "x"}}) is None  # not ours: no pool label
    m = parse_machine(
        {
            "metadata": {
                "name": "n",
                "labels": {"pool": "p"},
                "annotations": {
                    "cluster-autoscaler.kubernetes.io/scale-down-disabled": "true",
                    "quartermaster.io/provisioned-by": "qm-x",
                },
                "creationTimestamp": "2026-11-25T12:00:00Z",
            },
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        },
        "pool",
    )
    assert m is not None and m.ready and m.kept and not m.released and m.request == "qm-x"
    name = request_name("Cluster_A", "a100-burst", 7)
    assert name == name.lower() and len(name) <= 63 and name.endswith("-00007")
    assert request_name("a", "p", 1) != request_name("b", "p", 1)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=8),
    delays=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3)), min_size=8, max_size=8),
)
def test_whatever_the_sizes_and_delays_the_pool_never_holds_more_than_it_was_asked(
    sizes: list[int], delays: list[tuple[int, int]]
) -> None:
    """Rounds against a cluster-autoscaler model: each round the size may change, the plan's
    asks become requests, cancels and deletes remove them, marks are applied. A request is
    provisioned some rounds after it is made and its nodes register some rounds after that;
    deleting it before it is provisioned cancels it, after that its nodes come anyway. Nodes
    and what is coming never pass the largest size asked, and once the size holds still the
    pool reaches it."""
    requests: dict[str, Request] = {}
    machines: list[Machine] = []
    provision_at: dict[str, int] = {}
    arrive_at: dict[str, tuple[int, int]] = {}  # request: (round, count)
    seq, clock, most = 0, 0, 0
    for step in range(40):
        size = sizes[min(step // 3, len(sizes) - 1)]
        most = max(most, size)
        clock += 10
        for name, when in list(provision_at.items()):
            r = requests.get(name)
            if r is None:
                del provision_at[name]  # canceled before it was provisioned
            elif when <= step:
                requests[name] = replace(r, provisioned=True)
                arrive_at[name] = (when + delays[int(name[1:]) % len(delays)][1], r.count)
                del provision_at[name]
        for name, (when, count) in list(arrive_at.items()):
            if when <= step:
                machines += [node(f"{name}-n{i}", clock - 5, kept=False) for i in range(count)]
                del arrive_at[name]
        steps = plan({"p": size}, list(requests.values()), machines, at(clock))
        for r in steps.done + steps.cancel:
            requests.pop(r.name, None)
        machines = [
            replace(m, kept=True, request=steps.mark[m.name]) if m.name in steps.mark else m
            for m in machines
        ]
        for count in steps.ask.values():
            name = f"r{seq}"
            requests[name] = req(name, count, clock - 9)
            provision_at[name] = step + delays[seq % len(delays)][0]
            seq += 1
        promised = sum(c for _, c in arrive_at.values())
        assert len(machines) + promised <= most, (step, len(machines), promised, most)
    for _ in range(8):  # the size holds still: whatever is promised comes, the rest is asked
        clock += 10
        for name, (_when, count) in list(arrive_at.items()):
            machines += [node(f"{name}-n{i}", clock - 5) for i in range(count)]
            del arrive_at[name]
    settled = plan({"p": sizes[-1]}, list(requests.values()), machines, at(clock + 10))
    if len(machines) <= sizes[-1]:
        total = len(machines) + sum(settled.waiting.values()) + sum(settled.ask.values())
        assert total == sizes[-1]
