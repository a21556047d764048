"""Placement behaviour of one cycle: fit, gangs, topology, fractions, order and reasons."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

from core.capacity import Capacity
from core.cycle import CycleResult, schedule
from core.model import ClusterId, NodeId, PriceTier, TopologyLevel, WorkloadKind
from core.placement import Plan, _type_demand, commit
from core.policy import Policy
from core.reasons import ReasonCode
from tests.unit.core.builders import cluster, gang, gpu_nodes, job, running, snapshot


def run(snap: object, policy: Policy | None = None) -> CycleResult:
    return schedule(snap, policy or Policy.default(), now=100.0, rng=random.Random(0))  # type: ignore[arg-type]


def placed_ids(result: CycleResult) -> set[str]:
    return {a.job.job_id for a in result.placements}


def test_single_job_lands_on_acceptable_type() -> None:
    nodes = gpu_nodes(1, type="A100", prefix="a") | gpu_nodes(1, type="H100", prefix="h")
    result = run(snapshot(nodes, [job(2, job_id="x", types=("H100",))]))
    (alloc,) = result.placements
    assert alloc.replicas[0].node_id == "c1-h-0000"
    assert alloc.replicas[0].accelerators == 2


def test_unknown_type_is_explained_not_raised() -> None:
    result = run(snapshot(gpu_nodes(2), [job(1, job_id="x", types=("TPU-v5e",))]))
    assert result.placements == ()
    assert result.pending["x"].codes == (ReasonCode.NO_MATCHING_NODES,)
    assert "TPU-v5e" in result.pending["x"].message


def test_gang_is_all_or_nothing() -> None:
    result = run(snapshot(gpu_nodes(4), [gang(5, job_id="big"), gang(4, job_id="fits")]))
    assert placed_ids(result) == {"fits"}
    (alloc,) = result.placements
    assert len({r.node_id for r in alloc.replicas}) == 4
    assert result.pending["big"].codes[0] is ReasonCode.TOPOLOGY_TOO_SMALL


def test_gang_never_spans_clusters() -> None:
    nodes = gpu_nodes(2, cluster="east") | gpu_nodes(2, cluster="west")
    result = run(snapshot(nodes, [gang(3, job_id="g")]))
    assert result.placements == ()
    assert result.pending["g"].codes[0] is ReasonCode.TOPOLOGY_TOO_SMALL


def test_required_rack_topology() -> None:
    nodes = gpu_nodes(4, nodes_per_rack=2)
    required = gang(3, job_id="req", topology=TopologyLevel.RACK, required=True)
    preferred = gang(2, job_id="pref", topology=TopologyLevel.RACK)
    result = run(snapshot(nodes, [required, preferred]))
    assert placed_ids(result) == {"pref"}
    (alloc,) = result.placements
    assert {nodes[r.node_id].rack for r in alloc.replicas} == {"r0"}
    assert "rack" in result.pending["req"].message


def test_preferred_topology_widens_when_needed() -> None:
    nodes = gpu_nodes(4, nodes_per_rack=2)
    result = run(snapshot(nodes, [gang(3, job_id="g", topology=TopologyLevel.RACK)]))
    assert placed_ids(result) == {"g"}


def test_nvlink_message_names_type_and_size() -> None:
    nodes = gpu_nodes(2, nvlink_size=2)
    busy = running(job(1, job_id="r"), "c1-n-0000")
    want = gang(2, job_id="g", types=("H100",), topology=TopologyLevel.NVLINK, required=True)
    result = run(snapshot(nodes, [want], [busy]))
    assert result.pending["g"].codes[0] is ReasonCode.INSUFFICIENT_CAPACITY
    assert "no h100 nvlink domain with 16 free" in result.pending["g"].message.lower()


def test_running_work_is_never_overcommitted() -> None:
    nodes = gpu_nodes(1)
    busy = running(job(6, job_id="r"), "c1-n-0000")
    result = run(snapshot(nodes, [job(4, job_id="four"), job(2, job_id="two")], [busy]))
    assert placed_ids(result) == {"two"}


def test_unhealthy_and_excluded_nodes_are_skipped() -> None:
    nodes = gpu_nodes(3)
    sick = nodes["c1-n-0000"]
    nodes["c1-n-0000"] = type(sick)(**{**sick.__dict__, "healthy": False})
    result = run(snapshot(nodes, [job(8, job_id="x", excluded=["c1-n-0001"])]))
    assert result.placements[0].replicas[0].node_id == "c1-n-0002"


def test_fractions_share_one_device() -> None:
    nodes = gpu_nodes(1, gpus=1)
    jobs = [job(0.3, job_id=f"f{i}", submit=i) for i in range(4)]
    result = run(snapshot(nodes, jobs))
    assert placed_ids(result) == {"f0", "f1", "f2"}


def test_fraction_consumes_a_whole_device_from_whole_jobs() -> None:
    nodes = gpu_nodes(1, gpus=2)
    result = run(
        snapshot(nodes, [job(0.5, job_id="half", submit=0), job(2, job_id="two", submit=1)])
    )
    assert placed_ids(result) == {"half"}


def test_priority_class_goes_first() -> None:
    nodes = gpu_nodes(1)
    low = job(8, job_id="low", priority="low", submit=0)
    high = job(8, job_id="high", priority="high", submit=5)
    later_high = job(8, job_id="high2", priority="high", submit=6)
    result = run(snapshot(nodes, [low, high, later_high]))
    assert placed_ids(result) == {"high"}
    assert ReasonCode.BEHIND_HIGHER_PRIORITY in result.pending["low"].codes
    assert "waiting behind 1 higher-priority job" in result.pending["low"].message


def test_best_fit_prefers_the_fragmented_node() -> None:
    nodes = gpu_nodes(2)
    busy = running(job(6, job_id="r"), "c1-n-0001")
    result = run(snapshot(nodes, [job(2, job_id="x")], [busy]))
    assert result.placements[0].replicas[0].node_id == "c1-n-0001"


def test_cheaper_effective_cost_wins_across_clusters() -> None:
    nodes = gpu_nodes(1, cluster="pricey", type="H100") | gpu_nodes(1, cluster="cheap", type="H100")
    clusters = [cluster("pricey", {"H100": 9.0}), cluster("cheap", {"H100": 3.0})]
    result = run(snapshot(nodes, [job(1, job_id="x")], clusters=clusters))
    assert result.placements[0].cluster == "cheap"


def _typed_fleet() -> tuple[dict, list]:
    # L4 is the cheapest work per unit here, so cost alone sends flexible work to it.
    nodes = gpu_nodes(2, gpus=4, type="L4", prefix="l") | gpu_nodes(1, type="A100", prefix="a")
    return nodes, [cluster("c1", {"L4": 0.3, "A100": 2.0})]


def test_flexible_work_leaves_a_type_to_the_work_restricted_to_it() -> None:
    nodes, clusters = _typed_fleet()
    held = running(job(4, job_id="only-l4", types=("L4",)), "c1-l-0000")
    result = run(snapshot(nodes, [job(1, job_id="x")], [held], clusters=clusters))
    # Work that can run only on L4 holds half of it: the flexible job goes to A100, though L4
    # is cheaper, and leaves L4's last node to the work that has nowhere else to go.
    assert result.placements[0].replicas[0].node_id == "c1-a-0000"


def test_flexible_work_takes_the_cheapest_type_when_no_work_depends_on_it() -> None:
    nodes, clusters = _typed_fleet()
    # The same running work, but it could run anywhere: nothing to keep L4 for.
    held = running(job(4, job_id="any", types=("L4", "A100")), "c1-l-0000")
    result = run(snapshot(nodes, [job(1, job_id="x")], [held], clusters=clusters))
    assert result.placements[0].replicas[0].node_id.startswith("c1-l-")


def test_type_claims_follow_restricted_work_exactly() -> None:
    nodes, _ = _typed_fleet()
    cap = Capacity.build(nodes, {}, {})
    l4 = cap.type_names.index("L4")
    only_l4 = job(0.25, job_id="f", types=("L4",))
    placed = commit(
        cap, only_l4, Plan(ClusterId("c1"), ((cap.index[NodeId("c1-l-0001")], 1),)), 0.0
    )
    assert cap.type_claimed_milli.tolist()[l4] == 250
    what_if = cap.copy()
    what_if.release(placed.replicas, only_l4)
    assert not what_if.type_claimed_milli.any()
    assert cap.type_claimed_milli[l4] == 250  # the copy's books are its own
    assert cap.type_free_milli[l4] == 8_000 - 250
    # A job that accepts every type of the fleet is not restricted: it claims nothing.
    anywhere = job(1, job_id="g", types=("A100", "L4", "H100"))
    commit(cap, anywhere, Plan(ClusterId("c1"), ((cap.index[NodeId("c1-a-0000")], 1),)), 0.0)
    assert cap.type_claimed_milli.sum() == 250


def test_a_types_demand_is_reckoned_on_healthy_nodes_only() -> None:
    """Broken devices are no room: unhealthy nodes of the restricted type must not hide its
    shortage, nor unhealthy nodes of another type make the fleet look emptier."""
    nodes, _ = _typed_fleet()
    work = [running(job(4, job_id="only-l4", types=("L4",)), "c1-l-0000")]

    def demand(extra: dict) -> list[float]:
        cap = Capacity.build(nodes | extra, {}, {})
        cap.charge(work)
        found = _type_demand(cap, job(1), Policy.default().placement)
        assert found is not None
        return [round(float(found[cap.type_names.index(t)]), 6) for t in ("A100", "L4")]

    healthy = demand({})
    for type_name in ("L4", "A100"):
        broken = {
            k: replace(n, healthy=False)
            for k, n in gpu_nodes(6, gpus=4, type=type_name, prefix="x").items()
        }
        assert demand(broken) == healthy


def test_spot_only_for_preemptible_jobs() -> None:
    nodes = gpu_nodes(1, tier=PriceTier.SPOT)
    result = run(snapshot(nodes, [job(1, job_id="firm", preemptible=False), job(1, job_id="soft")]))
    assert placed_ids(result) == {"soft"}


def test_inference_service_spreads_replicas() -> None:
    nodes = gpu_nodes(4)
    svc = gang(4, gpus=1, job_id="svc", kind=WorkloadKind.INFERENCE_SERVICE)
    train = gang(4, gpus=1, job_id="train")
    result = run(snapshot(nodes, [svc, train]))
    by_job = {a.job.job_id: Counter(r.node_id for r in a.replicas) for a in result.placements}
    assert len(by_job["svc"]) == 4
    assert len(by_job["train"]) == 1


def test_invalid_request_is_explained() -> None:
    result = run(snapshot(gpu_nodes(1), [job(1.5, job_id="odd")]))
    assert result.pending["odd"].codes == (ReasonCode.INVALID_REQUEST,)


def test_a_replica_too_large_for_any_node_names_what_is_short() -> None:
    """8 GPUs fit a node, 120 cores and 720 GB do not: the reason says so, not the topology."""
    nodes = gpu_nodes(4)  # 8 GPUs, and fewer cores and less memory than asked
    biggest_cpu = max(n.cpu for n in nodes.values())
    biggest_mem = max(n.memory_gb for n in nodes.values())
    big = job(8, job_id="big", cpu=biggest_cpu + 24, memory_gb=biggest_mem + 100)
    result = run(snapshot(nodes, [big]))
    why = result.pending["big"]
    assert why.codes[0] is ReasonCode.REPLICA_TOO_LARGE
    assert f"{biggest_cpu + 24:g} CPU cores per replica" in why.message
    assert "GB of host memory" in why.message and "accelerators" not in why.message
    # Each resource alone fits some node, but no node has all of them.
    mixed = gpu_nodes(1, prefix="cpu", cpu=256, memory_gb=64) | gpu_nodes(
        1, prefix="mem", cpu=8, memory_gb=4096
    )
    odd = job(1, job_id="odd", cpu=200, memory_gb=2000)
    assert "at once" in run(snapshot(mixed, [odd])).pending["odd"].message
