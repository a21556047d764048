"""Where one job goes: pick the topology domain (the cluster is its top level) by a score of
effective cost, fit and availability, then the nodes inside it; gangs are all-or-nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from core.capacity import EPS, MILLI, Capacity, FloatArray, IntArray, milli
from core.model import (
    TOPOLOGY_ORDER,
    Allocation,
    ClusterId,
    JobRequest,
    NodeId,
    ReplicaPlacement,
    TopologyLevel,
    WorkloadKind,
)
from core.policy import PlacementPreferences
from core.reasons import Miss, ReasonCode

LEVEL_WORDS = {
    TopologyLevel.NODE: "node",
    TopologyLevel.NVLINK: "NVLink domain",
    TopologyLevel.RACK: "rack",
    TopologyLevel.BLOCK: "block",
    TopologyLevel.CLUSTER: "cluster",
}


class Shape(NamedTuple):
    """Everything about a job that decides where it can fit; jobs of one shape fit alike."""

    accelerators: float
    replicas: int
    accelerator_types: tuple[str, ...]
    accelerator_memory_gb: float | None
    cpu: float
    memory_gb: float
    topology: TopologyLevel
    topology_required: bool
    preemptible: bool
    kind: WorkloadKind
    excluded_nodes: frozenset[NodeId]
    # Whether the job declares a max runtime: only such jobs may backfill onto held capacity.
    bounded: bool

    @property
    def total_accelerators(self) -> float:
        return self.replicas * self.accelerators


def shape_of(job: JobRequest) -> Shape:
    return Shape(
        job.accelerators,
        job.replicas,
        job.accelerator_types,
        job.accelerator_memory_gb,
        job.cpu,
        job.memory_gb,
        job.topology,
        job.topology_required,
        job.preemptible,
        job.kind,
        job.excluded_nodes,
        job.max_runtime_s is not None,
    )


@dataclass(frozen=True)
class Plan:
    cluster: ClusterId
    # (node index in Capacity, replicas on that node), in replica order.
    nodes: tuple[tuple[int, int], ...]


def invalid_reason(job: JobRequest) -> Miss | None:
    """A request no fleet could ever satisfy as written (the queue should have rejected it)."""
    if job.replicas < 1:
        return Miss(ReasonCode.INVALID_REQUEST, f"the job asks for {job.replicas} replicas")
    if job.accelerators < 0 or (job.accelerators > 1 and job.accelerators != int(job.accelerators)):
        return Miss(
            ReasonCode.INVALID_REQUEST,
            f"{job.accelerators} accelerators per replica is neither a fraction nor whole",
        )
    return None


def levels_to_try(job: JobRequest) -> tuple[TopologyLevel, ...]:
    """A single replica always sits on one node; a preferred constraint widens level by level."""
    if job.replicas == 1:
        return (TopologyLevel.NODE,)
    if job.topology_required:
        return (job.topology,)
    return TOPOLOGY_ORDER[TOPOLOGY_ORDER.index(job.topology) :]


def find_placement(
    cap: Capacity,
    job: JobRequest,
    prefs: PlacementPreferences,
    cost_sensitivity: float,
    blocked_holds: frozenset[int] = frozenset(),
    precise: bool = True,
) -> Plan | Miss:
    """The best plan for `job` on the current free capacity, or why there is none (see
    `explain_miss` for `precise`)."""
    idx = usable_candidates(cap, job, prefs, blocked_holds)
    if idx.size == 0:
        return _miss_without_candidates(cap, job, prefs, blocked_holds)
    slots = cap.slots(idx, job.accelerators, job.cpu, job.memory_gb)
    for level in levels_to_try(job):
        plan = _place_at_level(cap, job, prefs, cost_sensitivity, idx, slots, level)
        if plan is not None:
            return plan
    return explain_miss(cap, job, prefs, blocked_holds, precise)


def _spot_ok(job: JobRequest, prefs: PlacementPreferences) -> bool:
    return job.preemptible or not prefs.spot_for_preemptible_only


def usable_candidates(
    cap: Capacity, job: JobRequest, prefs: PlacementPreferences, blocked_holds: frozenset[int]
) -> IntArray:
    """Nodes `job` may use: of its types and memory, spot only if allowed, none it must
    avoid, none held by a reservation in `blocked_holds`."""
    idx = cap.candidates(job.accelerator_types, job.accelerator_memory_gb, _spot_ok(job, prefs))
    if job.excluded_nodes:
        excluded = np.array(
            sorted(cap.index[n] for n in job.excluded_nodes if n in cap.index), dtype=np.int64
        )
        idx = idx[~np.isin(idx, excluded)]
    if blocked_holds:
        idx = _not_held(idx, cap.held[idx], blocked_holds)
    return idx


def _not_held(idx: IntArray, held: IntArray, blocked_holds: frozenset[int]) -> IntArray:
    keep = np.ones(idx.size, dtype=np.bool_)
    for number in blocked_holds:
        # A cycle holds capacity for a few gangs at most: one comparison each beats np.isin.
        keep &= held != number
    result: IntArray = idx[keep]
    return result


def _place_at_level(
    cap: Capacity,
    job: JobRequest,
    prefs: PlacementPreferences,
    cost_sensitivity: float,
    idx: IntArray,
    slots: IntArray,
    level: TopologyLevel,
) -> Plan | None:
    useful = slots >= job.replicas if level is TopologyLevel.NODE else slots > 0
    if not useful.any():
        return None
    idx, slots = idx[useful], slots[useful]
    weights = np.minimum(slots, job.replicas).astype(np.float64)
    if level is TopologyLevel.NODE:
        # Every remaining node is a feasible domain of its own.
        score = _scores(cap, job, prefs, cost_sensitivity, idx, weights, None)
        best = int(np.argmin(score))
        if job.replicas == 1:
            node = int(idx[best])
            return Plan(cap.cluster_names[int(cap.cluster_of[node])], ((node, 1),))
        return _fill(cap, job, idx[best : best + 1], slots[best : best + 1])
    codes = cap.domains[level][idx]
    per_domain = np.bincount(codes, weights=weights)
    feasible = per_domain >= job.replicas - EPS
    if not feasible.any():
        return None
    score = np.where(
        feasible, _scores(cap, job, prefs, cost_sensitivity, idx, weights, codes), np.inf
    )
    # argmin returns the first minimum: the lowest domain code, which is ordered by name.
    members = codes == int(np.argmin(score))
    return _fill(cap, job, idx[members], slots[members])


def _scores(
    cap: Capacity,
    job: JobRequest,
    prefs: PlacementPreferences,
    cost_sensitivity: float,
    idx: IntArray,
    weights: FloatArray,
    codes: IntArray | None,
) -> FloatArray:
    """Lower is better: effective cost, then fit, then how scarce the domain's cluster is.
    With `codes` None every node is its own domain and no aggregation is needed."""

    def per_domain(values: FloatArray) -> FloatArray:
        if codes is None:
            return values
        summed: FloatArray = np.bincount(codes, weights=values).astype(np.float64)
        return summed

    node_cost = cap.effective_cost[idx]
    cost = per_domain(node_cost * weights) / np.maximum(per_domain(weights), EPS)
    top_cost = float(node_cost.max())
    cost_norm = cost / top_cost if top_cost > 0 else np.zeros_like(cost)
    devices = per_domain(cap.devices[idx].astype(np.float64))
    leftover = (per_domain(cap.free_total[idx]) - job.total_accelerators) / np.maximum(devices, 1)
    # Best fit keeps whole nodes and domains free for big gangs. A service's replicas in a
    # spread group are kept apart by the group's own term below and otherwise fit best too;
    # other service work spreads by going to the emptiest nodes.
    emptiest = job.kind is WorkloadKind.INFERENCE_SERVICE and job.spread_group is None
    fit = 1.0 - leftover if emptiest else leftover
    if codes is None:
        domain_cluster = cap.cluster_of[idx]
    else:
        domain_cluster = np.zeros(len(cost), dtype=np.int64)
        domain_cluster[codes] = cap.cluster_of[idx]
    cluster_share = cap.cluster_free / np.maximum(cap.cluster_devices, 1.0)
    scarcity = 1.0 - cluster_share[domain_cluster]
    total: FloatArray = (
        prefs.cost_weight * cost_sensitivity * cost_norm
        + prefs.fit_weight * fit
        + prefs.availability_weight * scarcity
    )
    demand = _type_demand(cap, job, prefs)
    if demand is not None:
        node_demand = demand[cap.type_of[idx]]
        total = total + prefs.type_demand_weight * (
            per_domain(node_demand * weights) / np.maximum(per_domain(weights), EPS)
        )
    if job.spread_group is not None and job.spread_group in cap.spread:
        total = total + per_domain(_spread_penalty(cap, cap.spread[job.spread_group], idx))
    return total


# Past this, a type is simply "needed by the work restricted to it"; more says nothing.
TYPE_DEMAND_CAP = 3.0


def _type_demand(cap: Capacity, job: JobRequest, prefs: PlacementPreferences) -> FloatArray | None:
    """Per accelerator type: how much of its free room the work that can run only on some
    types is expected to need, relative to that room (None when it cannot change the choice,
    or must not: a job without accelerators, a replica of a spread group). Healthy nodes only.

    Work restricted to some types holds a share r of what runs on each type; as the rest of
    the free room fills, that work is expected to take r of it on its type. A type whose free
    room is below its expected share (value above 1) is one that restricted work depends on,
    so work that could go elsewhere should. Exact integer books feed it, so a kept state and a
    fresh one score alike."""
    claimed = cap.type_claimed_milli
    if (
        prefs.type_demand_weight == 0
        or job.accelerators <= 0
        or len(job.accelerator_types) == 1
        # A spread group's replicas must keep apart whatever a type's demand (SPREAD_NODE).
        or job.spread_group is not None
        or not claimed.any()
    ):
        return None
    free = cap.type_free_milli
    free_all = int(free.sum())
    used = int(cap.type_devices_milli.sum()) - free_all
    if used <= 0 or free_all < 0:
        return None
    expected = claimed.astype(np.float64) * (free_all / used)
    demand: FloatArray = np.minimum(expected / np.maximum(free, 1), TYPE_DEMAND_CAP)
    return demand


# A replica of the group already on the node outweighs any cost or fit difference (another
# node is taken whenever one fits); sharing a rack, then a cluster, with the group's replicas
# weighs about as much as the cost term, so spreading there is preferred but not at any price.
SPREAD_NODE = 4.0
SPREAD_RACK = 1.0
SPREAD_CLUSTER = 0.5


def _spread_penalty(cap: Capacity, on: dict[int, int], idx: IntArray) -> FloatArray:
    """For each node in `idx`: how much of the spread group is already on it, in its rack and
    in its cluster (shares of the group's replicas)."""
    nodes = np.fromiter(on.keys(), dtype=np.int64, count=len(on))
    counts = np.fromiter(on.values(), dtype=np.float64, count=len(on))
    total = float(counts.sum())
    racks = cap.domains[TopologyLevel.RACK]
    rack_count = np.bincount(racks[nodes], weights=counts, minlength=int(racks.max()) + 1)
    cluster_count = np.bincount(
        cap.cluster_of[nodes], weights=counts, minlength=len(cap.cluster_names)
    )
    node_count = np.zeros(len(cap.nodes), dtype=np.float64)
    node_count[nodes] = counts
    penalty: FloatArray = (
        SPREAD_NODE * node_count[idx]
        + SPREAD_RACK * rack_count[racks[idx]] / total
        + SPREAD_CLUSTER * cluster_count[cap.cluster_of[idx]] / total
    )
    return penalty


def _fill(cap: Capacity, job: JobRequest, members: IntArray, slots: IntArray) -> Plan:
    free = cap.free_accelerators(members)
    if job.kind is WorkloadKind.INFERENCE_SERVICE:
        # Emptiest first, one replica per node per round: a node failure takes few replicas.
        order = np.lexsort((members, -free))
        per_round = 1
    else:
        # Tightest first, as many as fit: fragments get used before whole nodes.
        order = np.lexsort((members, free))
        per_round = job.replicas
    remaining = job.replicas
    taken = dict.fromkeys((int(m) for m in members[order]), 0)
    room = {int(m): int(s) for m, s in zip(members, slots, strict=True)}
    while remaining > 0:
        for node in taken:
            k = min(room[node] - taken[node], per_round, remaining)
            if k > 0:
                taken[node] += k
                remaining -= k
            if remaining == 0:
                break
    chosen = tuple((node, k) for node, k in taken.items() if k > 0)
    return Plan(cluster=cap.cluster_names[int(cap.cluster_of[chosen[0][0]])], nodes=chosen)


def commit(cap: Capacity, job: JobRequest, plan: Plan, now: float) -> Allocation:
    """Charges the plan to the capacity and returns the allocation to publish."""
    replicas: list[ReplicaPlacement] = []
    for node, count in plan.nodes:
        for _ in range(count):
            devices = cap.take(node, job.accelerators, job.cpu, job.memory_gb)
            replicas.append(
                ReplicaPlacement(
                    replica=len(replicas),
                    node_id=cap.nodes[node].node_id,
                    accelerators=job.accelerators,
                    cpu=job.cpu,
                    memory_gb=job.memory_gb,
                    devices=devices,
                )
            )
    cap.count_job(job, replicas, 1)
    return Allocation(job=job, cluster=plan.cluster, replicas=tuple(replicas), start_time=now)


def _types_word(job: JobRequest) -> str:
    return "/".join(job.accelerator_types) if job.accelerator_types else "accelerator"


def _miss_without_candidates(
    cap: Capacity, job: JobRequest, prefs: PlacementPreferences, blocked_holds: frozenset[int]
) -> Miss:
    if blocked_holds and usable_candidates(cap, job, prefs, frozenset()).size > 0:
        return Miss(
            ReasonCode.CAPACITY_RESERVED,
            f"the matching {_types_word(job)} nodes are held for a larger waiting gang",
        )
    memory = (
        f" with at least {job.accelerator_memory_gb:g} GB per device"
        if job.accelerator_memory_gb is not None
        else ""
    )
    return Miss(
        ReasonCode.NO_MATCHING_NODES,
        f"no healthy node offers {_types_word(job)}{memory} to this job",
    )


def explain_miss(
    cap: Capacity,
    job: JobRequest,
    prefs: PlacementPreferences,
    blocked_holds: frozenset[int],
    precise: bool = True,
) -> Miss:
    """Why `job` does not fit now: impossible even on an idle fleet, held, or just busy.

    With `precise=False` (nobody reads the sentence) a job that would fit but for the holds
    is reported as short of capacity, which saves a second search; both are capacity codes."""
    level = levels_to_try(job)[-1]
    word = LEVEL_WORDS[level]
    empty = _empty_fit(cap, job, level, _spot_ok(job, prefs))
    if not empty:
        too_large = _replica_too_large(cap, job, _spot_ok(job, prefs))
        if too_large is not None:
            return Miss(ReasonCode.REPLICA_TOO_LARGE, too_large)
        return Miss(
            ReasonCode.TOPOLOGY_TOO_SMALL,
            f"even an empty fleet has no {_types_word(job)} {word} that can hold "
            f"{job.replicas} x {job.accelerators:g} accelerators",
        )
    if precise and blocked_holds and isinstance(find_placement(cap, job, prefs, 0.0), Plan):
        return Miss(
            ReasonCode.CAPACITY_RESERVED,
            f"free {_types_word(job)} capacity is held for a larger gang that is waiting",
        )
    shape = "" if job.replicas == 1 else f" ({job.replicas} replicas x {job.accelerators:g})"
    return Miss(
        ReasonCode.INSUFFICIENT_CAPACITY,
        f"no {_types_prefix(job)}{word} with {job.total_accelerators:g} free accelerators{shape}",
    )


def _types_prefix(job: JobRequest) -> str:
    return f"{'/'.join(job.accelerator_types)} " if job.accelerator_types else ""


def _empty_fit(cap: Capacity, job: JobRequest, level: TopologyLevel, spot_ok: bool) -> bool:
    """Whether the job would fit at `level` if every healthy candidate node were idle."""
    key = (shape_of(job), level, spot_ok)
    known = cap.empty_fits.get(key)
    if known is not None:
        return known
    idx = cap.candidates(job.accelerator_types, job.accelerator_memory_gb, spot_ok)
    fits = False
    if idx.size > 0:
        per_node = _empty_slots(cap, idx, job)
        totals = np.bincount(cap.domains[level][idx], weights=per_node)
        fits = bool((totals >= job.replicas - EPS).any())
    cap.empty_fits[key] = fits
    return fits


def _replica_too_large(cap: Capacity, job: JobRequest, spot_ok: bool) -> str | None:
    """Why no candidate node, even idle, can hold one replica, naming what is short (devices,
    CPU or host memory, with the most any node has); None when one replica fits somewhere."""
    idx = cap.candidates(job.accelerator_types, job.accelerator_memory_gb, spot_ok)
    if idx.size == 0 or bool((_empty_slots(cap, idx, job) >= 1).any()):
        return None
    devices = cap.devices[idx]
    needs = [
        ("accelerators", max(job.accelerators, 0.0), devices.astype(np.float64)),
        ("CPU cores", job.cpu, cap.node_cpu[idx]),
        ("GB of host memory", job.memory_gb, cap.node_memory[idx]),
    ]
    short = [
        f"{need:g} {what} per replica (the largest node has {float(have.max()):g})"
        for what, need, have in needs
        if need > 0 and not bool((have >= need - EPS).any())
    ]
    kind = f"{_types_word(job)} node"
    if short:
        return f"no {kind} can hold one replica: it asks for " + " and ".join(short)
    asked = ", ".join(f"{need:g} {what}" for what, need, _ in needs if need > 0)
    return f"no {kind} has {asked} at once, as one replica asks"


def _empty_slots(cap: Capacity, idx: IntArray, job: JobRequest) -> FloatArray:
    node_cpu = cap.node_cpu[idx]
    node_mem = cap.node_memory[idx]
    big = float(1 << 20)
    slots = np.full(idx.size, big)
    if job.cpu > 0:
        slots = np.minimum(slots, np.floor(node_cpu / job.cpu + EPS))
    if job.memory_gb > 0:
        slots = np.minimum(slots, np.floor(node_mem / job.memory_gb + EPS))
    devices = cap.devices[idx].astype(np.float64)
    if job.accelerators >= 1:
        slots = np.minimum(slots, np.floor(devices / round(job.accelerators)))
    elif job.accelerators > 0:
        slots = np.minimum(slots, devices * float(MILLI // milli(job.accelerators)))
    result: FloatArray = slots
    return result
