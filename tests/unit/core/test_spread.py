"""Replicas of one inference service (a spread group) are kept apart: never two on a node
while another fits, across racks and clusters when there is room, and otherwise they fit best,
so whole nodes stay free for gangs. A kept working set counts the group as a rebuilt one does."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

from core.cycle import CycleResult, decide, schedule
from core.model import JobRequest, WorkloadKind
from core.policy import Policy
from core.state import CycleState
from tests.unit.core.builders import cluster, gang, gpu_nodes, job, running, snapshot


def replica(group: str | None, n: int, gpus: float = 1) -> JobRequest:
    j = job(gpus, job_id=f"svc-{group}-{n}", kind=WorkloadKind.INFERENCE_SERVICE)
    return dataclasses.replace(j, spread_group=group)


def run(snap: object) -> CycleResult:
    return schedule(snap, Policy.default(), now=100.0, rng=random.Random(0))  # type: ignore[arg-type]


def nodes_of(result: CycleResult) -> list[str]:
    return [a.replicas[0].node_id for a in result.placements]


def test_replicas_of_a_group_go_to_different_nodes_racks_and_then_partly_used_nodes() -> None:
    # 2 racks x 4 nodes of 8 GPUs; a batch job already uses 4 GPUs on n-0000 and n-0004.
    nodes = gpu_nodes(8, nodes_per_rack=4)
    busy = [running(job(4, job_id="b1"), "c1-n-0000"), running(job(4, job_id="b2"), "c1-n-0004")]
    result = run(snapshot(nodes, [replica("chat", i) for i in range(4)], busy))
    placed = nodes_of(result)
    assert len(set(placed)) == 4, placed  # never two on one node
    racks = Counter(nodes[n].rack for n in placed)
    assert racks == {"r0": 2, "r1": 2}, placed  # spread over both racks
    # Fit best otherwise: the two partly used nodes are taken before empty ones.
    assert {"c1-n-0000", "c1-n-0004"} <= set(placed), placed


def test_without_a_group_service_work_still_goes_to_the_emptiest_nodes() -> None:
    nodes = gpu_nodes(4)
    busy = [running(job(4, job_id="b1"), "c1-n-0000")]
    result = run(snapshot(nodes, [replica(None, 0)], busy))
    assert nodes_of(result) != ["c1-n-0000"]


def test_spread_leaves_whole_nodes_for_a_gang() -> None:
    # 4 nodes of 8: three half-used; 3 one-GPU replicas then an 8-GPU job.
    nodes = gpu_nodes(4)
    busy = [running(job(4, job_id=f"b{i}"), f"c1-n-000{i}") for i in range(3)]
    pending = [*(replica("chat", i) for i in range(3)), gang(1, 8, job_id="big", submit=1.0)]
    result = run(snapshot(nodes, pending, busy))
    where = {a.job.job_id: a.replicas[0].node_id for a in result.placements}
    assert where.get("big") == "c1-n-0003", where  # the only whole node is kept for it
    assert len({where[f"svc-chat-{i}"] for i in range(3)}) == 3, where


def test_two_replicas_share_a_node_only_when_nothing_else_fits() -> None:
    nodes = gpu_nodes(2)
    busy = [running(job(8, job_id="full"), "c1-n-0001")]
    result = run(snapshot(nodes, [replica("chat", 0), replica("chat", 1)], busy))
    assert nodes_of(result) == ["c1-n-0000", "c1-n-0000"]


def test_a_kept_state_counts_the_group_as_a_rebuilt_one() -> None:
    nodes = gpu_nodes(6)
    policy = Policy.default()
    first = [replica("chat", i) for i in range(3)]
    state = CycleState.from_snapshot(snapshot(nodes, first), policy)
    placed = decide(state, policy, 100.0).placements
    assert sum(state.cap.spread["chat"].values()) == 3
    rebuilt = CycleState.from_snapshot(snapshot(nodes, running_jobs=state.running.values()), policy)
    assert rebuilt.cap.spread == state.cap.spread
    state.release(placed[0].job.job_id)
    assert sum(state.cap.spread["chat"].values()) == 2
    for a in placed[1:]:
        state.release(a.job.job_id)
    assert "chat" not in state.cap.spread


def test_a_types_demand_never_puts_two_replicas_on_one_node() -> None:
    """Work restricted to A100 holds most of it, so flexible work would rather avoid A100; a
    replica of a spread group still takes the A100 node over the L4 node its group is on."""
    pol = Policy.from_dict({"placement": {"cost_weight": 2.0}})
    nodes = gpu_nodes(1, type="L4", prefix="l") | gpu_nodes(1, type="A100", prefix="a")
    clusters = [cluster("c1", {"A100": 2.0})]  # L4 unpriced: the cheapest there is
    held = [
        running(replica("g", 0), "c1-l-0000"),
        running(job(7, job_id="a-only", types=("A100",)), "c1-a-0000"),
    ]
    snap = snapshot(nodes, [replica("g", 1)], held, clusters=clusters)
    result = schedule(snap, pol, now=0.0, rng=random.Random(0))
    assert nodes_of(result) == ["c1-a-0000"]
