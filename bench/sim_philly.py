"""Benchmark: replay the Philly trace through the simulator (the scheduling core itself).

1. The full trace (82,247 jobs) into one 64 x 8 pool, once per policy: wall time of each
   replay (`wall_s` is the default policy's, the one the live scheduler runs).
2. October-November 2017 (68,510 jobs) into the same pool, offered load printed: average JCT
   against strict FIFO in the same run, utilization while a backlog exists, over-commit.
3. The same window with per-tenant quotas from philly_vc_nodes.csv scaled to the pool, the
   default policy and fair share alone: each tenant's entitlement, its share of the demand,
   and the share of the pool it held while some of its jobs waited.
Ends with one JSON line (shared BENCH.md). Skips with a message when the traces are absent.

    .venv/bin/python -m bench.sim_philly            # everything (a few minutes on 2 cores)
    .venv/bin/python -m bench.sim_philly --no-full  # only the Oct-Nov comparisons
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

# Runnable as a file (`task bench` does `python bench/sim_philly.py`) as well as with -m.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe
from core.policy import Policy
from sim.engine import Simulation
from sim.fleet import Fleet, pool_fleet
from sim.report import offered_load, summarize
from sim.runner import Comparison, compare, vc_entitlement
from sim.variants import variant
from sim.workload import SimJob, Window, load_philly

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces"
POOL = "64x8"
WINDOW = "2017-10-01:2017-11-30"
# The policy file (learned service levels and repacking), without repacking, fair share alone,
# and the baselines.
POLICIES = ("fifo", "fifo-backfill", "fair-share", "no-repack", "default", "las")
INTERVAL_S = 60.0
# The bars, checked (not enforced) at the end: average JCT against FIFO with greedy backfill in
# the same run, and utilization while a backlog exists (issue 16).
WALL_BAR_S = 60.0
JCT_RATIO_BAR = 0.5
UTILIZATION_BAR = 0.93


def fleet(pol: Policy) -> Fleet:
    return pool_fleet(POOL, pol)


def full_replays(
    base: Policy, jobs: list[SimJob], policies: list[str]
) -> tuple[dict[str, float], int]:
    """Wall seconds of one whole-trace replay per policy (loading the trace not included), and
    the over-commits counted in all of them."""
    walls, overcommit = {}, 0
    for name in policies:
        pol = variant(base, name)
        clusters, nodes = fleet(pol)
        started = time.perf_counter()
        sim = Simulation(clusters, nodes, pol, jobs, INTERVAL_S)
        records = sim.run()
        walls[name] = time.perf_counter() - started
        s = summarize(records, sim.trace)
        overcommit += s["overcommit"]
        print(
            f"  {name:14s} wall {walls[name]:6.1f} s  finished {s['finished']}/{s['jobs']}  "
            f"avg JCT {s['avg_jct_s']:9.0f} s  overcommit {s['overcommit']}",
            flush=True,
        )
    return walls, overcommit


def quality(run: Comparison) -> None:
    fifo = run.summaries.get("fifo", {}).get("avg_jct_s", 0.0)
    for name, s in run.summaries.items():
        ratio = s["avg_jct_s"] / fifo if fifo else float("nan")
        print(
            f"  {name:14s} avg JCT {s['avg_jct_s']:8.0f} s  vs fifo {ratio:.3f}  "
            f"p99 {s['p99_jct_s']:8.0f}  queue {s['avg_queueing_s']:8.0f} s  "
            f"util(backlog) {s['utilization_backlog']:.3f}  preempt {s['preemptions']:5d}  "
            f"overcommit {s['overcommit']}  wall {s['wall_s']:.1f} s"
        )


def tenants(quota_run: Comparison, name: str = "default") -> dict[str, dict[str, float]]:
    s = quota_run.summaries[name]
    print(
        f"  {name} with quotas: avg JCT {s['avg_jct_s']:.0f} s, util(backlog) "
        f"{s['utilization_backlog']:.3f}, preemptions {s['preemptions']} (all reasons), "
        f"overcommit {s['overcommit']}, wall {s['wall_s']:.1f} s"
    )
    print("  tenant   entitled  demand  held while waiting  (hours waiting)")
    out = {}
    for tenant, v in s["tenants"].items():
        print(
            f"  {tenant}   {v['entitlement']:.3f}    {v['share']:.3f}   "
            f"{v['share_backlogged']:.3f}               ({v['backlogged_s'] / 3600:.0f})"
        )
        out[tenant] = {
            "entitled": round(v["entitlement"], 4),
            "demand": round(v["share"], 4),
            "held_while_waiting": round(v["share_backlogged"], 4),
        }
    return out


def bars(walls: dict[str, float], run: Comparison) -> list[str]:
    lines = []
    if "default" in walls:
        ok = walls["default"] <= WALL_BAR_S
        lines.append(
            f"{'met' if ok else 'MISSED'}: full replay (default policy) "
            f"{walls['default']:.1f} s <= {WALL_BAR_S:g} s"
        )
    baseline = run.summaries.get("fifo-backfill", {}).get("avg_jct_s")
    for name in ("default", "no-repack", "fair-share", "learned", "las"):
        s = run.summaries.get(name)
        if s is None or not baseline:
            continue
        ratio, util = s["avg_jct_s"] / baseline, s["utilization_backlog"]
        ok = ratio <= JCT_RATIO_BAR and util >= UTILIZATION_BAR and s["overcommit"] == 0
        lines.append(
            f"{'met' if ok else 'MISSED'}: {name} avg JCT {ratio:.3f} x fifo-backfill "
            f"(<= {JCT_RATIO_BAR}), "
            f"util while backlog {util:.3f} (>= {UTILIZATION_BAR}), overcommit {s['overcommit']}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-full", action="store_true", help="skip the whole-trace replays")
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args(argv)
    philly = TRACES / "philly.csv"
    if not philly.exists():
        print(f"skipped: {philly} not found (see shared/traces/README.md)")
        return
    base = Policy.from_dict(yaml.safe_load((ROOT / "examples/policy.yaml").read_text()))
    policies = [p for p in args.policies.split(",") if p]
    capacity = float(sum(n.accelerators for n in fleet(base)[1].values()))
    started = time.perf_counter()

    full = load_philly(philly)
    full_load = offered_load(full, capacity)
    walls: dict[str, float] = {}
    full_overcommit = 0
    if not args.no_full:
        print(f"full trace: {len(full)} jobs into {POOL}, offered load {full_load:.3f}", flush=True)
        walls, full_overcommit = full_replays(base, full, policies)

    window = load_philly(philly, Window.parse(WINDOW))
    load = offered_load(window, capacity)
    print(f"Oct-Nov 2017: {len(window)} jobs into {POOL}, offered load {load:.3f}", flush=True)
    run = compare(fleet, base, window, policies, INTERVAL_S)
    quality(run)

    ent = vc_entitlement(
        TRACES / "philly_vc_nodes.csv", [j.request.tenant for j in window], capacity
    )
    print("Oct-Nov 2017 with per-VC quotas scaled to the pool (one cohort, reclaim on):")
    quota_policies = [p for p in ("fair-share", "default") if p == "default" or p in policies]
    quota_run = compare(fleet, base, window, quota_policies, INTERVAL_S, entitlement=ent)
    shares = {name: tenants(quota_run, name) for name in quota_policies}

    for line in bars(walls, run):
        print(line)
    fifo = run.summaries.get("fifo", {}).get("avg_jct_s", 0.0)
    backfilled = run.summaries.get("fifo-backfill", {}).get("avg_jct_s", 0.0)
    runs: list[dict[str, Any]] = [*run.summaries.values(), *quota_run.summaries.values()]
    print(
        json.dumps(
            {
                "bench": "sim_philly",
                "wall_s": round(walls["default"], 1) if "default" in walls else None,
                "jobs": len(full),
                "offered_load": round(load, 3),
                "avg_jct_s": {k: round(s["avg_jct_s"]) for k, s in run.summaries.items()},
                "jct_ratio_vs_fifo": {
                    k: round(s["avg_jct_s"] / fifo, 4) if fifo else None
                    for k, s in run.summaries.items()
                },
                "jct_ratio_vs_fifo_backfill": {
                    k: round(s["avg_jct_s"] / backfilled, 4) if backfilled else None
                    for k, s in run.summaries.items()
                },
                "utilization_backlog": {
                    k: round(s["utilization_backlog"], 3) for k, s in run.summaries.items()
                },
                # Counted independently of the core's books, over every replay above.
                "overcommit": full_overcommit + sum(s["overcommit"] for s in runs),
                "full_wall_s": {k: round(v, 1) for k, v in walls.items()},
                "window_wall_s": {k: round(s["wall_s"], 1) for k, s in run.summaries.items()},
                "preemptions": {k: s["preemptions"] for k, s in run.summaries.items()},
                "quota_tenants": shares["default"],
                "quota_tenants_by_policy": shares,
                "total_wall_s": round(time.perf_counter() - started, 1),
                "setup": {
                    **describe(),
                    "pool": POOL,
                    "window": WINDOW,
                    "window_jobs": len(window),
                    "full_offered_load": round(full_load, 3),
                    "cycle_interval_s": INTERVAL_S,
                    "argv": sys.argv[1:],
                },
            }
        )
    )


if __name__ == "__main__":
    main()
