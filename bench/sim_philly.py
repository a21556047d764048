"""Benchmark: replay the Philly trace through fifo, fifo-backfill, default and LAS policies.

1. The full trace (82,247 jobs) into a 64 x 8 pool: wall time of the whole replay.
2. October-November 2017 into the same pool (offered load printed): JCT vs FIFO, utilization
   while a backlog exists, over-commit count.
3. The same window with per-tenant quotas from philly_vc_nodes.csv scaled to the pool: each
   tenant's share vs its entitlement under the default policy.
Ends with one JSON line (see shared BENCH.md). Skips with a message when the traces are absent.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml

from core.policy import Policy
from sim.fleet import pool_fleet
from sim.report import offered_load
from sim.runner import compare, vc_entitlement
from sim.workload import Window, load_philly

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces"
POOL = "64x8"
POLICIES = ["fifo", "fifo-backfill", "default", "las"]


def main() -> None:
    philly = TRACES / "philly.csv"
    if not philly.exists():
        print(f"skipped: {philly} not found (see shared/traces/README.md)")
        return
    base = Policy.from_dict(yaml.safe_load((ROOT / "examples/policy.yaml").read_text()))
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else POLICIES

    def fleet(pol: Policy):  # type: ignore[no-untyped-def]
        return pool_fleet(POOL, pol)

    capacity = 512.0
    full = load_philly(philly)
    started = time.perf_counter()
    full_run = compare(fleet, base, full, only)
    wall_full = time.perf_counter() - started
    print(
        f"full trace: {len(full)} jobs, offered load {offered_load(full, capacity):.3f}, "
        f"wall {wall_full:.1f} s ({', '.join(f'{k} {v:.1f}s' for k, v in full_run.wall_s.items())})"
    )

    window = load_philly(philly, Window.parse("2017-10-01:2017-11-30"))
    load = offered_load(window, capacity)
    print(f"Oct-Nov 2017: {len(window)} jobs into {POOL}, offered load {load:.3f}")
    run = compare(fleet, base, window, only)
    fifo = run.summaries.get("fifo", {}).get("avg_jct_s", 0.0)
    for name, s in run.summaries.items():
        ratio = s["avg_jct_s"] / fifo if fifo else float("nan")
        print(
            f"  {name:14s} avg JCT {s['avg_jct_s']:9.0f} s  ratio {ratio:.3f}  "
            f"queue {s['avg_queueing_s']:9.0f} s  util(backlog) {s['utilization_backlog']:.3f}  "
            f"preempt {s['preemptions']}  overcommit {s['overcommit']}  wall {s['wall_s']:.1f}s"
        )

    ent = vc_entitlement(
        TRACES / "philly_vc_nodes.csv", [j.request.tenant for j in window], capacity
    )
    quota_run = compare(fleet, base, window, ["default"], entitlement=ent)
    print("Oct-Nov with per-VC quotas (default policy): tenant share vs entitlement")
    for tenant, v in quota_run.summaries["default"]["tenants"].items():
        print(f"  {tenant}: share {v['share']:.3f}  entitlement {v['entitlement']:.3f}")

    print(
        json.dumps(
            {
                "bench": "sim_philly",
                "wall_s": round(wall_full, 1),
                "jobs": len(full),
                "offered_load": round(load, 3),
                "avg_jct_s": {k: round(s["avg_jct_s"]) for k, s in run.summaries.items()},
                "jct_ratio_vs_fifo": {
                    k: round(s["avg_jct_s"] / fifo, 4) if fifo else None
                    for k, s in run.summaries.items()
                },
                "utilization_backlog": {
                    k: round(s["utilization_backlog"], 3) for k, s in run.summaries.items()
                },
                "overcommit": sum(s["overcommit"] for s in run.summaries.values())
                + sum(s["overcommit"] for s in full_run.summaries.values()),
                "setup": {
                    "cores": os.cpu_count(),
                    "pool": POOL,
                    "window": "2017-10-01:2017-11-30",
                    "full_offered_load": round(offered_load(full, capacity), 3),
                    "cycle_interval_s": 60,
                    "python": sys.version.split()[0],
                },
            }
        )
    )


if __name__ == "__main__":
    main()
