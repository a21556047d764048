"""Invariants of a cycle over random fleets and workloads (Hypothesis)."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from core.capacity import EPS
from core.cycle import CycleResult, schedule
from core.model import Allocation, JobRequest, Node, NodeId, Snapshot, TopologyLevel
from core.policy import Policy
from core.reasons import ReasonCode
from tests.unit.core.builders import gpu_nodes, job, snapshot

LEVEL_ATTR = {
    TopologyLevel.NODE: "node_id",
    TopologyLevel.NVLINK: "nvlink_domain",
    TopologyLevel.RACK: "rack",
    TopologyLevel.BLOCK: "block",
    TopologyLevel.CLUSTER: "cluster",
}


@st.composite
def fleets(draw: st.DrawFn) -> dict[NodeId, Node]:
    nodes: dict[NodeId, Node] = {}
    for c in range(draw(st.integers(1, 3))):
        for g, type_name in enumerate(
            draw(st.lists(st.sampled_from(["H100", "A100"]), max_size=2))
        ):
            nodes |= gpu_nodes(
                draw(st.integers(1, 6)),
                gpus=draw(st.sampled_from([1, 2, 4, 8])),
                type=type_name,
                cluster=f"c{c}",
                prefix=f"g{g}",
                nodes_per_rack=draw(st.integers(1, 3)),
                racks_per_block=2,
                nvlink_size=draw(st.integers(1, 2)),
                cpu=draw(st.sampled_from([8.0, 64.0])),
            )
    return nodes


@st.composite
def jobs(draw: st.DrawFn, index: int) -> JobRequest:
    gpus = draw(st.sampled_from([0, 0.25, 0.5, 1, 2, 4, 8]))
    return job(
        gpus,
        job_id=f"j{index:03d}",
        replicas=1 if gpus < 1 else draw(st.integers(1, 4)),
        priority=draw(st.sampled_from(["low", "normal", "high"])),
        types=tuple(draw(st.sets(st.sampled_from(["H100", "A100"]), max_size=2))),
        topology=draw(st.sampled_from(list(TopologyLevel))),
        required=draw(st.booleans()),
        submit=float(draw(st.integers(0, 5))),
        cpu=float(draw(st.integers(0, 8))),
        preemptible=draw(st.booleans()),
    )


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    nodes = draw(fleets())
    pending = [draw(jobs(i)) for i in range(draw(st.integers(0, 25)))]
    # Running work comes from an earlier cycle, so it is itself a valid state.
    first = schedule(snapshot(nodes, pending[::2]), Policy.default(), 0.0, random.Random(0))
    return snapshot(nodes, pending[1::2], first.placements)


def _check_no_overcommit(snap: Snapshot, result: CycleResult) -> None:
    whole: dict[NodeId, float] = defaultdict(float)
    fraction: dict[NodeId, float] = defaultdict(float)
    cpu: dict[NodeId, float] = defaultdict(float)
    for alloc in [*snap.running.values(), *result.placements]:
        for r in alloc.replicas:
            (whole if r.accelerators >= 1 else fraction)[r.node_id] += r.accelerators
            cpu[r.node_id] += r.cpu
    for node_id, node in snap.nodes.items():
        assert whole[node_id] + fraction[node_id] <= node.accelerators + EPS
        assert cpu[node_id] <= node.cpu + EPS


def _check_gang(snap: Snapshot, result: CycleResult) -> None:
    for alloc in result.placements:
        j = alloc.job
        assert len(alloc.replicas) == j.replicas
        placed = [snap.nodes[r.node_id] for r in alloc.replicas]
        assert {n.cluster for n in placed} == {alloc.cluster}
        assert all(n.healthy and n.node_id not in j.excluded_nodes for n in placed)
        if j.accelerator_types:
            assert all(n.accelerator.type in j.accelerator_types for n in placed)
        if j.topology_required:
            assert len({getattr(n, LEVEL_ATTR[j.topology]) for n in placed}) == 1


@settings(max_examples=150, deadline=None)
@given(snapshots())
def test_no_overcommit_and_gangs_whole(snap: Snapshot) -> None:
    result = schedule(snap, Policy.default(), 10.0, random.Random(1))
    _check_no_overcommit(snap, result)
    _check_gang(snap, result)
    placed = {a.job.job_id for a in result.placements}
    assert placed.isdisjoint(result.pending)
    assert placed | set(result.pending) == {j.job_id for j in snap.pending}


@settings(max_examples=60, deadline=None)
@given(snapshots(), st.randoms(use_true_random=False))
def test_same_inputs_same_decisions(snap: Snapshot, shuffler: random.Random) -> None:
    pending = list(snap.pending)
    shuffler.shuffle(pending)
    node_items = list(snap.nodes.items())
    shuffler.shuffle(node_items)
    shuffled = Snapshot(snap.clusters, dict(node_items), snap.running, pending, snap.usage)
    first = schedule(snap, Policy.default(), 10.0, random.Random(1))
    second = schedule(shuffled, Policy.default(), 10.0, random.Random(2))
    assert first == second


QUOTA_POLICY = Policy.from_dict(
    {
        "tenants": {
            "a": {"cohort": "c", "quotas": {"H100": 16, "A100": 8}, "borrow_limit": {"H100": 16}},
            "b": {"cohort": "c", "quotas": {"H100": 8}, "lend_limit": {"H100": 4}},
            "c": {"cohort": "c", "quotas": {"*": 0}},
        },
        "preemption": {"min_runtime_s": 0},
    }
)


@st.composite
def quota_snapshots(draw: st.DrawFn) -> Snapshot:
    nodes = draw(fleets())
    pending = []
    for i in range(draw(st.integers(0, 30))):
        j = draw(jobs(i))
        pending.append(replace(j, tenant=draw(st.sampled_from(["a", "b", "c"]))))
    first = schedule(snapshot(nodes, pending[::2]), QUOTA_POLICY, 0.0, random.Random(0))
    return snapshot(nodes, pending[1::2], first.placements)


def _usage(allocs: list[Allocation], nodes: dict[NodeId, Node]) -> dict[tuple[str, str], float]:
    used: dict[tuple[str, str], float] = defaultdict(float)
    for a in allocs:
        if a.job.accelerators > 0:
            type_name = nodes[a.replicas[0].node_id].accelerator.type
            used[(a.job.tenant, type_name)] += a.job.total_accelerators
    return used


@settings(max_examples=120, deadline=None)
@given(quota_snapshots())
def test_quota_exceeded_only_by_permitted_borrowing(snap: Snapshot) -> None:
    """Replays the cycle's placements in order: any placement that makes its tenant borrow
    (more) must fit the tenant's borrowing limit and what the cohort could lend at that moment.
    Lenders may later use their own nominal quota; that makes the loan reclaimable, not illegal."""
    result = schedule(snap, QUOTA_POLICY, 10.0, random.Random(1))
    nodes = dict(snap.nodes)
    used = _usage(list(snap.running.values()), nodes)
    for alloc in result.placements:
        if alloc.job.accelerators <= 0:
            continue
        type_name = nodes[alloc.replicas[0].node_id].accelerator.type
        tenant = QUOTA_POLICY.tenants[alloc.job.tenant]
        key = (alloc.job.tenant, type_name)
        nominal = tenant.nominal(type_name) or 0.0
        before = max(0.0, used[key] - nominal)
        used[key] += alloc.job.total_accelerators
        after = max(0.0, used[key] - nominal)
        if after <= before + EPS:
            continue
        assert after <= tenant.max_borrow(type_name) + EPS
        borrowed, lendable = 0.0, 0.0
        for name, member in QUOTA_POLICY.tenants.items():
            n = member.nominal(type_name) or 0.0
            borrowed += max(0.0, used[(name, type_name)] - n)
            lendable += min(member.max_lend(type_name), max(0.0, n - used[(name, type_name)]))
        assert borrowed <= lendable + EPS


@settings(max_examples=120, deadline=None)
@given(quota_snapshots())
def test_victims_never_have_equal_or_higher_claim(snap: Snapshot) -> None:
    result = schedule(snap, QUOTA_POLICY, 10.0, random.Random(1))
    before = _usage(list(snap.running.values()), dict(snap.nodes))
    pending = {j.job_id: j for j in snap.pending}
    for decision in result.preemptions:
        preemptor = pending[decision.for_job]
        mine = QUOTA_POLICY.rank(preemptor.priority_class)
        for victim in decision.victims:
            alloc = snap.running[victim.job_id]
            theirs = QUOTA_POLICY.rank(alloc.job.priority_class)
            assert alloc.job.preemptible
            assert theirs <= mine
            if theirs == mine:
                # Same priority: only capacity the victim's tenant borrowed may be reclaimed.
                type_name = snap.nodes[alloc.replicas[0].node_id].accelerator.type
                tenant = QUOTA_POLICY.tenants[alloc.job.tenant]
                assert before[(alloc.job.tenant, type_name)] > (tenant.nominal(type_name) or 0)
                assert victim.reason is ReasonCode.RECLAIMED_BORROWED
            else:
                assert QUOTA_POLICY.priority(preemptor.priority_class).preempting
