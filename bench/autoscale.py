"""Benchmark: an elastic cloud pool driven by the autoscaler's decision (`core.autoscale`, the
code the autoscaler service runs), replayed on the Philly trace in the simulator.

A fixed on-prem pool of 48 x 8 GPUs and a cloud pool of 0-32 x 8 (on-demand price of the
policy file's `--price-type`, 3 minutes to provision, 10 minutes cool-down), compared in one
run: no cloud pool, the cloud pool always at 32, and the autoscaler; then the autoscaler with a
monthly cloud budget below what it spent unbounded (so below what "always 32" spends, and
binding). For each: average JCT, p99 queueing, cloud
GPU-hours bought and used, cost, idle share. The aim (issue 12): average JCT within 1.1x of
"always 32" for at most 60% of its cloud cost; with the budget, spend stays within it and the
tenants whose demand went unserved for it are named.

    .venv/bin/python bench/autoscale.py                                   # 2017-10-01:2017-11-30
    .venv/bin/python bench/autoscale.py --window 2017-10-01:2017-10-07   # a week

Ends with one JSON line (shared BENCH.md). Skips with a message when the trace is absent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe
from core.autoscale import NodePool
from core.model import AcceleratorModel, Cluster, ClusterId, ClusterKind, PriceTier
from core.policy import Policy
from services.common.policyfile import load_policy
from sim.elastic import ElasticSimulation, PoolMode, SpendBudget
from sim.fleet import pool_fleet
from sim.report import offered_load, summarize
from sim.workload import SimJob, Window, load_philly

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "philly.csv"
ACCELERATOR = "GPU"  # the pool fleet's type: Philly jobs accept any
JCT_BAR = 1.1
COST_BAR = 0.6


def cloud_pool(args: argparse.Namespace, policy: Policy) -> NodePool:
    price = policy.prices.get((args.price_type, PriceTier.ON_DEMAND))
    if price is None:
        raise SystemExit(f"the policy has no on-demand price for {args.price_type}")
    return NodePool(
        name="cloud-od",
        cluster=ClusterId("cloud"),
        accelerator=AcceleratorModel(ACCELERATOR, ACCELERATOR, 0.0, 1.0),
        accelerators_per_node=8,
        cpu=96,
        memory_gb=1024,
        price_tier=PriceTier.ON_DEMAND,
        price=price,
        min_nodes=0,
        max_nodes=args.cloud_max,
        provision_s=args.provision_s,
        cooldown_s=args.cooldown_s,
    )


def run(
    name: str,
    mode: PoolMode,
    jobs: list[SimJob],
    policy: Policy,
    pool: NodePool,
    onprem: str,
    budget: SpendBudget | None = None,
) -> dict[str, Any]:
    clusters, nodes = pool_fleet(onprem, policy)
    prices = {(ACCELERATOR, PriceTier.ON_DEMAND): pool.price}
    clusters = {**clusters, pool.cluster: Cluster(pool.cluster, "cloud", ClusterKind.CLOUD, prices)}
    started = time.perf_counter()
    sim = ElasticSimulation(clusters, nodes, policy, jobs, [pool], mode, budget)
    records = sim.run()
    wall = time.perf_counter() - started
    summary = summarize(records, sim.trace)
    bill = sim.bills[pool.name]
    bought_h = bill.bought_s / 3600.0
    used_h = bill.used_s / 3600.0
    figures = {
        "avg_jct_s": round(summary["avg_jct_s"], 1),
        "p99_queueing_s": round(summary["p99_queueing_s"], 1),
        "finished": summary["finished"],
        "cloud_gpu_h_bought": round(bought_h, 1),
        "cloud_gpu_h_used": round(used_h, 1),
        "cloud_cost": round(bill.cost, 2),
        "idle_share": round(1 - used_h / bought_h, 3) if bought_h else 0.0,
        "nodes_bought": bill.nodes_bought,
        "peak_nodes": bill.peak_nodes,
        "scale_ups": bill.scale_ups,
        "scale_downs": bill.scale_downs,
        "overcommit": summary["overcommit"],
        "wall_s": round(wall, 1),
    }
    if budget is not None:
        figures["budget"] = budget.amount
        periods = sim.spend_by_period(budget.period_s)
        figures["spend_by_30_days"] = [round(x, 2) for x in periods]
        figures["within_budget"] = all(x <= budget.amount + 0.01 for x in periods)
        figures["unserved_for_budget"] = {
            t: len(j) for t, j in sorted(sim.unserved_for_budget.items())
        }
    print(
        f"  {name:18s} avg JCT {figures['avg_jct_s']:9.0f} s  p99 queue "
        f"{figures['p99_queueing_s']:9.0f} s  cloud GPU-h bought {bought_h:9.0f} used "
        f"{used_h:9.0f}  cost {bill.cost:10.0f}  idle {figures['idle_share']:.1%}  "
        f"peak {bill.peak_nodes} nodes  ({wall:.0f} s)",
        flush=True,
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", default="2017-10-01:2017-11-30")
    parser.add_argument("--onprem", default="48x8")
    parser.add_argument("--cloud-max", type=int, default=32)
    parser.add_argument("--provision-s", type=float, default=180.0)
    parser.add_argument("--cooldown-s", type=float, default=600.0)
    parser.add_argument("--price-type", default="A100", help="policy price used for the pool")
    parser.add_argument(
        "--budget-share",
        type=float,
        default=0.5,
        help="monthly cloud budget as a share of what the unbounded autoscaler spends per month",
    )
    parser.add_argument("--policy", type=Path, default=ROOT / "examples" / "policy.yaml")
    args = parser.parse_args()
    if not TRACE.exists():
        print(f"skipped: {TRACE} not found (see shared/traces/README.md)")
        return
    policy = load_policy(args.policy)
    jobs = load_philly(TRACE, Window.parse(args.window))
    pool = cloud_pool(args, policy)
    onprem_gpus = int(args.onprem.split("x")[0]) * int(args.onprem.split("x")[1])
    load = offered_load(jobs, onprem_gpus)
    print(
        f"Philly {args.window}: {len(jobs)} jobs, offered load {load:.3f} on {args.onprem} "
        f"on-prem; cloud pool 0-{args.cloud_max} x 8 at {pool.price}/GPU-h, provisioning "
        f"{args.provision_s:.0f} s, cool-down {args.cooldown_s:.0f} s",
        flush=True,
    )
    results = {
        "none": run("no cloud pool", PoolMode.NONE, jobs, policy, pool, args.onprem),
        "always_max": run(
            f"always {args.cloud_max}", PoolMode.ALWAYS, jobs, policy, pool, args.onprem
        ),
        "autoscale": run("autoscaler", PoolMode.AUTOSCALE, jobs, policy, pool, args.onprem),
    }
    always = results["always_max"]
    # The replay's length: "always max" pays for every node from start to end.
    span_s = max(always["cloud_gpu_h_bought"] * 3600 / (8 * max(args.cloud_max, 1)), 1.0)
    monthly = results["autoscale"]["cloud_cost"] * (30 * 86400) / span_s
    budget = SpendBudget(round(monthly * args.budget_share, 2))
    results["autoscale_budget"] = run(
        "autoscaler + budget", PoolMode.AUTOSCALE, jobs, policy, pool, args.onprem, budget
    )
    auto = results["autoscale"]
    jct_ratio = auto["avg_jct_s"] / always["avg_jct_s"] if always["avg_jct_s"] else 0.0
    cost_ratio = auto["cloud_cost"] / always["cloud_cost"] if always["cloud_cost"] else 0.0
    capped = results["autoscale_budget"]
    months = span_s / (30 * 86400)
    print(
        f"autoscaler vs always {args.cloud_max}: JCT {jct_ratio:.3f}x (aim <= {JCT_BAR}), "
        f"cost {cost_ratio:.3f}x (aim <= {COST_BAR}); with a budget of {budget.amount:.0f} "
        f"per 30 days ({months:.2f} months replayed): spent {capped['spend_by_30_days']} "
        f"(within it: {capped['within_budget']}), "
        f"unserved for the budget by tenant: {capped.get('unserved_for_budget')}",
        flush=True,
    )
    print(
        json.dumps(
            {
                "bench": "autoscale",
                "jct_ratio_vs_always_max": round(jct_ratio, 3),
                "cost_ratio_vs_always_max": round(cost_ratio, 3),
                "avg_jct_s": {k: v["avg_jct_s"] for k, v in results.items()},
                "cloud_cost": {k: v["cloud_cost"] for k, v in results.items()},
                "variants": results,
                "setup": {
                    **describe(),
                    "trace": "philly",
                    "window": args.window,
                    "jobs": len(jobs),
                    "offered_load_onprem": round(load, 3),
                    "onprem": args.onprem,
                    "cloud_pool": f"0-{args.cloud_max}x8",
                    "price_per_gpu_h": pool.price,
                    "provision_s": args.provision_s,
                    "cooldown_s": args.cooldown_s,
                    "budget_per_30_days": budget.amount,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
