"""Benchmark: one full scheduling cycle with 10,000 pending jobs on 5,000 nodes x 8 accelerators
across 3 clusters. Prints figures, then one JSON line (see shared BENCH.md)."""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import statistics
import sys
import time

import numpy as np

from core.cycle import schedule
from core.fleet import load_fleet
from core.model import JobId, JobRequest, Snapshot, TenantId, TopologyLevel, WorkloadKind
from core.policy import Policy

NODES_PER_CLUSTER = (2000, 2000, 1000)
TYPES = ("H100", "A100", "H100")
TENANTS = ("vision", "nlp", "speech", "research", "platform")
PENDING = 10_000


def fleet_doc() -> dict[str, object]:
    clusters = []
    for i, (count, type_name) in enumerate(zip(NODES_PER_CLUSTER, TYPES, strict=True)):
        clusters.append(
            {
                "name": f"c{i}",
                "location": f"region-{i}",
                "kind": "on_prem" if i == 0 else "cloud",
                "prices": {type_name: {"on_demand": 2.0 + i}},
                "node_groups": [
                    {
                        "prefix": "n",
                        "count": count,
                        "accelerator_type": type_name,
                        "accelerators_per_node": 8,
                        "nodes_per_rack": 8,
                        "racks_per_block": 8,
                    }
                ],
            }
        )
    return {"clusters": clusters}


def policy() -> Policy:
    quota = {"H100": 8000, "A100": 4000}
    return Policy.from_dict(
        {
            "tenants": {t: {"cohort": "all", "quotas": quota} for t in TENANTS},
            "backfill": {"mode": "reserve", "max_reservations": 2},
        }
    )


def workload(rng: random.Random) -> list[JobRequest]:
    jobs = []
    for i in range(PENDING):
        draw = rng.random()
        if draw < 0.7:
            gpus, replicas = 1, 1
        elif draw < 0.9:
            gpus, replicas = rng.randint(2, 8), 1
        else:
            gpus, replicas = 8, rng.randint(2, 16)
        jobs.append(
            JobRequest(
                job_id=JobId(f"job-{i:05d}"),
                tenant=TenantId(rng.choice(TENANTS)),
                project="bench",
                user="bench",
                queue="default",
                priority_class=rng.choice(["normal", "normal", "normal", "high", "low"]),
                kind=WorkloadKind.TRAINING,
                replicas=replicas,
                accelerators=gpus,
                accelerator_types=rng.choice([(), ("H100",), ("A100",)]),
                accelerator_memory_gb=None,
                cpu=4.0,
                memory_gb=32.0,
                topology=TopologyLevel.RACK if replicas > 1 else TopologyLevel.CLUSTER,
                topology_required=False,
                preemptible=True,
                submit_time=float(i),
            )
        )
    return jobs


def main() -> None:
    rng = random.Random(7)
    clusters, nodes = load_fleet(fleet_doc())
    snap = Snapshot(clusters=clusters, nodes=nodes, running={}, pending=workload(rng))
    pol = policy()
    times, placed = [], 0
    for run in range(5):
        start = time.perf_counter()
        result = schedule(snap, pol, now=1e6, rng=random.Random(run))
        times.append(time.perf_counter() - start)
        placed = len(result.placements)
    cycle_s = statistics.median(times)
    used = sum(r.accelerators for a in result.placements for r in a.replicas)
    print(f"nodes={len(nodes)} accelerators={8 * len(nodes)} pending={PENDING}")
    print(f"cycle times (s): {', '.join(f'{t:.3f}' for t in times)}  median {cycle_s:.3f}")
    print(f"placed {placed} jobs using {used:.0f} accelerators; explained {len(result.pending)}")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "bench": "core_cycle",
                "cycle_s": round(cycle_s, 4),
                "placements_per_s": round(placed / cycle_s, 1),
                "pending": PENDING,
                "nodes": len(nodes),
                "placed": placed,
                "peak_rss_mb": round(peak_rss_mb, 1),
                "setup": {
                    "cores": os.cpu_count(),
                    "accelerators": 8 * len(nodes),
                    "clusters": len(clusters),
                    "python": sys.version.split()[0],
                    "numpy": np.__version__,
                    "machine": platform.machine(),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
