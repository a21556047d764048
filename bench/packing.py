"""Benchmark: how many GPUs a placement policy leaves unallocatable. A seeded stream of GPU
requests (fractional shares of a device, whole and multi-GPU replicas, some restricted to one
accelerator type) arrives into an empty heterogeneous fleet until the demand that arrived equals
the fleet's capacity; requests that fit nowhere are turned away. What is left unallocated then is
capacity stranded by the policy's choices. Each mix is run, in the same process, with the core's
placement (`core.placement.find_placement`, the policy file's defaults), best-fit and random-fit
on the same exact per-device books (`core.capacity.Capacity`).

Prints a table per mix, then one JSON line (keys in the shared BENCH.md)."""

from __future__ import annotations

import heapq
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.capacity import MILLI, Capacity
from core.model import (
    AcceleratorModel,
    ClusterId,
    JobRequest,
    Node,
    NodeId,
    PriceTier,
    ReplicaPlacement,
)
from core.placement import Plan, commit, find_placement
from core.policy import Policy
from sim.workload import _request

TYPES = {
    "H100": (AcceleratorModel("H100", "hopper", 80, 3.0), 8),
    "A100": (AcceleratorModel("A100", "ampere", 40, 1.6), 8),
    "L4": (AcceleratorModel("L4", "ada", 24, 0.5), 4),
    "T4": (AcceleratorModel("T4", "turing", 16, 0.3), 2),
}
# Nodes per type: 3,200 GPUs on 600 nodes by default.
FLEET = {"H100": 120, "A100": 160, "L4": 160, "T4": 160}
PRICES = {"H100": 4.0, "A100": 2.0, "L4": 0.7, "T4": 0.35}
SEEDS = (1, 2, 3)
# The steady state: offered load, warm-up and horizon in mean holding times.
STEADY_LOAD = 1.2
STEADY_WARMUP = 2.0
STEADY_HORIZON = 8.0

# Request mixes: (share of fractional requests, whole sizes with weights, share restricted to
# one type). Fractions follow published GPU-sharing traces: mostly quarters and halves, the
# rest spread from 0.05 to 0.95.
MIXES: dict[str, tuple[float, dict[int, float], float]] = {
    "sharing": (0.70, {1: 0.60, 2: 0.20, 4: 0.12, 8: 0.08}, 0.10),
    "multi-gpu": (0.30, {1: 0.40, 2: 0.20, 4: 0.25, 8: 0.15}, 0.33),
    "constrained": (0.60, {1: 0.60, 2: 0.20, 4: 0.12, 8: 0.08}, 0.60),
}


def fleet() -> dict[NodeId, Node]:
    nodes = {}
    for type_name, count in FLEET.items():
        model, per_node = TYPES[type_name]
        for i in range(count):
            node_id = NodeId(f"{type_name.lower()}-{i:04d}")
            nodes[node_id] = Node(
                node_id=node_id,
                cluster=ClusterId("c"),
                block=f"{type_name}-b{i // 32}",
                rack=f"{type_name}-r{i // 8}",
                nvlink_domain=str(node_id),
                accelerator=model,
                accelerators=per_node,
                cpu=128,
                memory_gb=1024,
                price_tier=PriceTier.ON_DEMAND,
            )
    return nodes


def fraction(rng: random.Random) -> float:
    roll = rng.random()
    if roll < 0.35:
        return 0.25
    if roll < 0.65:
        return 0.5
    return round(rng.uniform(0.05, 0.95), 2)


def stream(mix: str, capacity: float, seed: int) -> list[JobRequest]:
    """Requests until their demand reaches the fleet's capacity."""
    rng = random.Random(seed)
    share_fraction, sizes, restricted = MIXES[mix]
    whole, weights = list(sizes), list(sizes.values())
    jobs: list[JobRequest] = []
    demand = 0.0
    while demand < capacity:
        accelerators = (
            fraction(rng)
            if rng.random() < share_fraction
            else float(rng.choices(whole, weights)[0])
        )
        fits = [t for t, (_, per) in TYPES.items() if per >= accelerators]
        types = (rng.choice(fits),) if rng.random() < restricted else ()
        # One replica on one node: the workload kind and topology level do not matter here.
        jobs.append(_request(f"r{len(jobs):06d}", float(len(jobs)), "t", 1, accelerators, types))
        demand += accelerators
    return jobs


Chooser = Callable[[Capacity, JobRequest], int | None]


def feasible(cap: Capacity, job: JobRequest) -> np.ndarray:
    idx = cap.candidates(job.accelerator_types, None, True)
    return idx[cap.slots(idx, job.accelerators, 0.0, 0.0) >= 1]


def best_fit(cap: Capacity, job: JobRequest) -> int | None:
    idx = feasible(cap, job)
    if idx.size == 0:
        return None
    return int(idx[np.argmin(cap.free_milli[idx])])


def random_fit(seed: int) -> Chooser:
    rng = random.Random(seed)

    def choose(cap: Capacity, job: JobRequest) -> int | None:
        idx = feasible(cap, job)
        return int(idx[rng.randrange(idx.size)]) if idx.size else None

    return choose


Placed = tuple[int, tuple[int, ...]]


def placer(policy: str, seed: int) -> Callable[[Capacity, JobRequest], Placed | None]:
    """Places one request on `cap` by `policy`: (node, devices taken), or None if refused."""
    pol = Policy.default()
    chooser = random_fit(seed) if policy == "random-fit" else best_fit

    def place(cap: Capacity, job: JobRequest) -> Placed | None:
        if policy == "default":
            plan = find_placement(cap, job, pol.placement, 1.0, precise=False)
            if not isinstance(plan, Plan):
                return None
            (replica,) = commit(cap, job, plan, 0.0).replicas
            return cap.index[replica.node_id], replica.devices
        node = chooser(cap, job)
        if node is None:
            return None
        devices = cap.take(node, job.accelerators, 0.0, 0.0)
        # Kept on the same books as the core's own placements, though these choosers ignore it.
        cap.count_job(job, (_replica(cap, job, node, devices),), 1)
        return node, devices

    return place


def _replica(
    cap: Capacity, job: JobRequest, node: int, devices: tuple[int, ...]
) -> ReplicaPlacement:
    return ReplicaPlacement(0, cap.nodes[node].node_id, job.accelerators, 0.0, 0.0, devices)


def new_capacity(nodes: dict[NodeId, Node]) -> Capacity:
    return Capacity.build(nodes, {}, {(t, PriceTier.ON_DEMAND): p for t, p in PRICES.items()})


def run(
    nodes: dict[NodeId, Node], jobs: list[JobRequest], policy: str, seed: int
) -> dict[str, float]:
    cap = new_capacity(nodes)
    place = placer(policy, seed)
    placed = refused = 0
    placed_gpus = 0.0
    started = time.perf_counter()
    for job in jobs:
        if place(cap, job) is None:
            refused += 1
            continue
        placed += 1
        placed_gpus += job.accelerators
    elapsed = time.perf_counter() - started
    total = int(cap.devices.sum()) * MILLI
    used = total - int(cap.free_milli.sum())
    return {
        "unallocated_gpus": (total - used) / MILLI,
        "placed": placed,
        "placed_gpus": placed_gpus,
        "refused": refused,
        "ms_per_decision": 1000 * elapsed / max(len(jobs), 1),
        "device_overcommit": int((cap.device_used > MILLI).sum()),
    }


def steady(nodes: dict[NodeId, Node], mix: str, policy: str, seed: int) -> dict[str, float]:
    """A steady state: requests of the mix arrive (Poisson) at an offered load of
    `STEADY_LOAD` x capacity and each holds its devices for an exponential time (mean 1); a
    request that fits nowhere is turned away. The unallocated GPUs are averaged over time after
    a warm-up, when the fleet is saturated and what stays free is what placement stranded."""
    capacity = float(sum(n.accelerators for n in nodes.values()))
    rng = random.Random(seed * 7919)
    shapes = stream(mix, capacity * STEADY_HORIZON * STEADY_LOAD, seed)
    mean = sum(j.accelerators for j in shapes) / len(shapes)
    rate = STEADY_LOAD * capacity / mean
    cap = new_capacity(nodes)
    place = placer(policy, seed)
    leaving: list[tuple[float, int, int, JobRequest, tuple[int, ...]]] = []
    now = area = refused_gpus = offered_gpus = 0.0
    for k, job in enumerate(shapes):
        arrive = now + rng.expovariate(rate)
        while leaving and leaving[0][0] <= arrive:
            at, _, node, done, devices = heapq.heappop(leaving)
            if at >= STEADY_WARMUP:
                area += int(cap.free_milli.sum()) / MILLI * (at - max(now, STEADY_WARMUP))
            now = at
            cap.release((_replica(cap, done, node, devices),), done)
        if arrive >= STEADY_WARMUP:
            area += int(cap.free_milli.sum()) / MILLI * (arrive - max(now, STEADY_WARMUP))
        now = arrive
        if now > STEADY_HORIZON:
            break
        placed = place(cap, job)
        if now >= STEADY_WARMUP:
            offered_gpus += job.accelerators
        if placed is None:
            if now >= STEADY_WARMUP:
                refused_gpus += job.accelerators
            continue
        heapq.heappush(leaving, (now + rng.expovariate(1.0), k, placed[0], job, placed[1]))
    span = max(now - STEADY_WARMUP, 1e-9)
    return {
        "unallocated_gpus": area / span,
        "refused_share": refused_gpus / max(offered_gpus, 1e-9),
        "device_overcommit": int((cap.device_used > MILLI).sum()),
    }


def main() -> None:
    nodes = fleet()
    capacity = float(sum(n.accelerators for n in nodes.values()))
    policies = ("default", "best-fit", "random-fit")
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for mix in MIXES:
        results[mix] = {p: [] for p in policies}
        for seed in SEEDS:
            jobs = stream(mix, capacity, seed)
            for p in policies:
                results[mix][p].append(run(nodes, jobs, p, seed))
    print(f"fleet: {len(nodes)} nodes, {capacity:.0f} GPUs ({FLEET}); seeds {SEEDS}")
    summary: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    overcommit = 0
    for mix, by_policy in results.items():
        print(f"\nmix {mix}: median of {len(SEEDS)} streams")
        print(
            f"  {'policy':<12}{'unallocated GPUs':>18}{'share':>8}{'refused':>9}{'ms/decision':>13}"
        )
        summary[mix] = {}
        for p, runs in by_policy.items():
            unallocated = float(np.median([r["unallocated_gpus"] for r in runs]))
            refused = float(np.median([r["refused"] for r in runs]))
            ms = float(np.median([r["ms_per_decision"] for r in runs]))
            overcommit += sum(int(r["device_overcommit"]) for r in runs)
            summary[mix][p] = round(unallocated, 2)
            print(
                f"  {p:<12}{unallocated:>18.2f}{unallocated / capacity:>8.1%}"
                f"{refused:>9.0f}{ms:>13.3f}"
            )
        ratio = summary[mix]["default"] / max(summary[mix]["best-fit"], 1e-9)
        ratios[mix] = round(ratio, 3)
        print(f"  default / best-fit: {ratio:.3f}")
    steady_summary: dict[str, dict[str, float]] = {}
    steady_ratios: dict[str, float] = {}
    print(
        f"\nsteady state: offered load {STEADY_LOAD:g} x capacity, exponential holding times, "
        f"time-averaged after a warm-up; median of {len(SEEDS)} seeds"
    )
    for mix in MIXES:
        print(f"\nmix {mix} (steady)")
        print(f"  {'policy':<12}{'unallocated GPUs':>18}{'share':>8}{'refused demand':>16}")
        steady_summary[mix] = {}
        for p in policies:
            runs = [steady(nodes, mix, p, seed) for seed in SEEDS]
            unallocated = float(np.median([r["unallocated_gpus"] for r in runs]))
            refused = float(np.median([r["refused_share"] for r in runs]))
            overcommit += sum(int(r["device_overcommit"]) for r in runs)
            steady_summary[mix][p] = round(unallocated, 2)
            print(f"  {p:<12}{unallocated:>18.2f}{unallocated / capacity:>8.1%}{refused:>16.1%}")
        ratio = steady_summary[mix]["default"] / max(steady_summary[mix]["best-fit"], 1e-9)
        steady_ratios[mix] = round(ratio, 3)
        print(f"  default / best-fit: {ratio:.3f}")
    worst = max(ratios.values())
    print(f"\nworst mix ratio default / best-fit: {worst:.3f}; device over-commit: {overcommit}")
    print(
        json.dumps(
            {
                "bench": "packing",
                "unallocated_gpus": summary,
                "unallocated_ratio_vs_bestfit": worst,
                "ratio_by_mix": ratios,
                "steady_unallocated_gpus": steady_summary,
                "steady_ratio_by_mix": steady_ratios,
                "device_overcommit": overcommit,
                "setup": {
                    "cores": os.cpu_count(),
                    "nodes": len(nodes),
                    "gpus": capacity,
                    "fleet": FLEET,
                    "seeds": list(SEEDS),
                    "steady": {
                        "load": STEADY_LOAD,
                        "warmup": STEADY_WARMUP,
                        "horizon": STEADY_HORIZON,
                    },
                    "python": platform.python_version(),
                    "numpy": np.__version__,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
