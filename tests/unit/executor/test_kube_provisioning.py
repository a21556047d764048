"""Elastic pools on Kubernetes (services/executor/kube/provisioning.py): what is on its way is
read from the cluster (open requests less the nodes that joined since), so the same decision
never asks twice; failed requests lose their nodes; only unprovisioned requests are canceled."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from services.executor.kube.provisioning import (
    Machine,
    Request,
    parse_machine,
    parse_request,
    plan,
    remaining,
    request_name,
)

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def req(name: str, count: int, s: float, pool: str = "p", **kw: object) -> Request:
    return Request(name, pool, count, at(s), **kw)  # type: ignore[arg-type]


def node(name: str, s: float, pool: str = "p", **kw: object) -> Machine:
    options = {"ready": True, "kept": True, "released": False, **kw}
    return Machine(name, pool, at(s), **options)  # type: ignore[arg-type]


def test_missing_nodes_are_asked_once_and_what_is_coming_counts() -> None:
    assert plan({"p": 3}, [], []).ask == {"p": 3}
    coming = [req("r1", 2, 0)]
    assert plan({"p": 3}, coming, [node("a", -10)]).ask == {}
    # Two of them came: nothing is missing and the met request goes.
    joined = [node("a", -10), node("b", 5), node("c", 6)]
    steps = plan({"p": 3}, [req("r1", 2, 0, provisioned=True)], joined)
    assert steps.ask == {} and [r.name for r in steps.done] == ["r1"]
    assert steps.waiting == {}


def test_a_node_counts_for_the_oldest_request_made_before_it() -> None:
    requests = [req("r1", 1, 0), req("r2", 2, 10)]
    left = remaining(requests, [node("a", 5), node("b", 11), node("c", 12)])
    assert left == {"r1": 0, "r2": 0}
    # A node of the same second as a request does not count for it.
    assert remaining([req("r", 1, 7)], [node("a", 7)]) == {"r": 1}


def test_beyond_the_size_newest_unprovisioned_requests_go_but_none_newer_than_the_inventory() -> (
    None
):
    requests = [req("r1", 1, 0, provisioned=True), req("r2", 1, 10), req("r3", 2, 20)]
    steps = plan({"p": 1}, requests, [])
    assert [r.name for r in steps.cancel] == ["r3", "r2"]
    # A request made after the decision's inventory was not known to it: it stays.
    steps = plan({"p": 1}, requests, [], since=at(15))
    assert [r.name for r in steps.cancel] == ["r2"]


def test_a_failed_request_loses_its_nodes_and_a_quiet_pool_asks_nothing() -> None:
    requests = [req("r1", 2, 0, failed="stockout")]
    steps = plan({"p": 2}, requests, [], quiet={"p"})
    assert [r.name for r in steps.done] == ["r1"]
    assert steps.failures["p"][1] == 2
    assert steps.ask == {}
    # Not in the round it failed either (the size drops first); afterwards, if not quiet.
    assert plan({"p": 2}, requests, []).ask == {}
    assert plan({"p": 2}, [], []).ask == {"p": 2}


def test_released_nodes_are_not_the_pools_and_unkept_ones_get_kept() -> None:
    machines = [node("a", 0, released=True, kept=False), node("b", 0, kept=False)]
    steps = plan({"p": 2}, [], machines)
    assert steps.ask == {"p": 1}
    assert steps.keep == ["b"]


def test_the_clusters_objects_parse_and_names_are_valid() -> None:
    obj = {
        "metadata": {
            "name": "qm-x",
            "labels": {"quartermaster.io/pool": "p"},
            "creationTimestamp": "2026-11-25T12:00:00Z",
        },
        "spec": {"podSets": [{"count": 2}, {"count": 1}]},
        "status": {
            "conditions": [
                {"type": "Provisioned", "status": "True"},
                {"type": "Failed", "status": "False"},
            ]
        },
    }
    r = parse_request(obj)
    assert r is not None and (r.count, r.provisioned, r.failed, r.created_at) == (3, True, None, T0)
    assert parse_request({"metadata": {"name": "x"}}) is None  # not ours: no pool label
    m = parse_machine(
        {
            "metadata": {
                "name": "n",
                "labels": {"pool": "p"},
                "annotations": {"cluster-autoscaler.kubernetes.io/scale-down-disabled": "true"},
                "creationTimestamp": "2026-11-25T12:00:00Z",
            },
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        },
        "pool",
    )
    assert m is not None and m.ready and m.kept and not m.released
    name = request_name("Cluster_A", "A100-Burst", 7)
    assert name == name.lower() and len(name) <= 63 and name.endswith("-00007")
    assert request_name("a", "p", 1) != request_name("b", "p", 1)


@given(
    size=st.integers(0, 8),
    counts=st.lists(st.integers(1, 4), max_size=4),
    joined=st.integers(0, 10),
)
def test_after_asking_and_canceling_what_plan_says_the_pool_is_its_size(
    size: int, counts: list[int], joined: int
) -> None:
    """Whatever is open and has joined: after the asks and cancels `plan` says, joined + coming
    is the size, or above it by less than the smallest request left (requests go whole)."""
    requests = [req(f"r{i}", c, i * 10) for i, c in enumerate(counts)]
    machines = [node(f"n{i}", 100 + i) for i in range(joined)]
    steps = plan({"p": size}, requests, machines)
    canceled = {r.name for r in steps.cancel}
    assert canceled.isdisjoint(steps.waiting)
    coming = sum(steps.waiting.values())
    asked = steps.ask.get("p", 0)
    total = joined + coming + asked
    if joined >= size:
        assert coming == 0 and asked == 0
    else:
        assert total >= size
        assert total == size or (asked == 0 and total - size < min(steps.waiting.values()))
