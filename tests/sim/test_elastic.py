"""The simulator with an elastic pool (sim/elastic.py): the autoscaler's decision buys nodes for
a gang that waits, they join after the provisioning delay, go after the cool-down once empty,
spend stays within a budget, and a busy node is never removed."""

from __future__ import annotations

import random

from core.autoscale import NodePool
from core.model import AcceleratorModel, Cluster, ClusterId, ClusterKind, PriceTier
from core.policy import Policy
from sim.elastic import ElasticSimulation, PoolMode, SpendBudget
from sim.fleet import pool_fleet
from sim.report import summarize
from sim.workload import SimJob, _request

GPU = AcceleratorModel("GPU", "GPU", 0.0, 1.0)


def pool(max_nodes: int = 4) -> NodePool:
    return NodePool(
        name="cloud",
        cluster=ClusterId("cloud"),
        accelerator=GPU,
        accelerators_per_node=8,
        cpu=96,
        memory_gb=1024,
        price_tier=PriceTier.ON_DEMAND,
        price=2.0,
        max_nodes=max_nodes,
        provision_s=180,
        cooldown_s=600,
    )


def simulation(
    jobs: list[SimJob], mode: PoolMode, max_nodes: int = 4, budget: SpendBudget | None = None
) -> ElasticSimulation:
    policy = Policy()
    clusters, nodes = pool_fleet("2x8", policy)
    p = pool(max_nodes)
    prices = {("GPU", PriceTier.ON_DEMAND): p.price}
    clusters = {**clusters, p.cluster: Cluster(p.cluster, "cloud", ClusterKind.CLOUD, prices)}
    return ElasticSimulation(clusters, nodes, policy, jobs, [p], mode, budget, cycle_interval_s=0)


def test_a_waiting_gang_buys_nodes_that_join_late_and_leave_once_empty() -> None:
    # The on-prem pool (2 x 8) is full for an hour; a 2 x 8 gang arrives and waits.
    jobs = [
        SimJob(_request("filler", 0.0, "a", 2, 8), 3600.0),
        SimJob(_request("gang", 10.0, "b", 2, 8), 1000.0),
    ]
    sim = simulation(jobs, PoolMode.AUTOSCALE)
    records = sim.run()
    gang = records["gang"]  # type: ignore[index]
    # Bought at its arrival, ready 180 s later: it starts then, not after the filler.
    assert gang.first_start == 10.0 + 180.0
    bill = sim.bills["cloud"]
    assert (bill.nodes_bought, bill.peak_nodes, bill.scale_downs) == (2, 2, 2)
    # Paid from the request until 600 s after the gang ended.
    assert bill.bought_s == 2 * 8 * (180.0 + 1000.0 + 600.0)
    assert bill.used_s == 2 * 8 * 1000.0
    assert summarize(records, sim.trace)["overcommit"] == 0


def test_always_pays_for_every_node_and_none_buys_nothing() -> None:
    jobs = [SimJob(_request("j", 0.0, "a", 1, 8), 100.0)]
    always = simulation(jobs, PoolMode.ALWAYS, max_nodes=3)
    always.run()
    assert always.bills["cloud"].bought_s == 3 * 8 * 100.0
    none = simulation(jobs, PoolMode.NONE)
    none.run()
    assert none.bills["cloud"].nodes_bought == 0


def test_a_random_workload_stays_within_the_pool_and_the_budget() -> None:
    rng = random.Random(5)
    jobs = [
        SimJob(
            _request(f"j{i}", rng.uniform(0, 20_000), "abc"[i % 3], rng.choice([1, 1, 2]), 8),
            rng.uniform(300, 5000),
        )
        for i in range(120)
    ]
    unbounded = simulation(jobs, PoolMode.AUTOSCALE, max_nodes=6)
    unbounded.run()
    assert unbounded.bills["cloud"].peak_nodes <= 6
    budget = SpendBudget(amount=unbounded.bills["cloud"].cost / 3, period_s=86400.0)
    capped = simulation(jobs, PoolMode.AUTOSCALE, max_nodes=6, budget=budget)
    records = capped.run()
    assert all(x <= budget.amount + 1e-6 for x in capped.spend_by_period(budget.period_s))
    assert capped.unserved_for_budget  # someone's demand waited for the budget
    assert all(r.finish is not None for r in records.values())
    assert summarize(records, capped.trace)["overcommit"] == 0
