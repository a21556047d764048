"""The autoscaler's decision (core.autoscale): scale up by gang shape onto the cheapest pool
that fits, never twice for the same demand, within pool limits and the spend allowed; scale
down only empty nodes past the cool-down, never below the minimum."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.autoscale import Demand, NodePool, PoolNode, SpendLimit, decide
from core.model import AcceleratorModel, ClusterId, PriceTier, TopologyLevel
from tests.unit.core.builders import MODELS, job

H100 = MODELS["H100"]
A100 = MODELS["A100"]


def pool(
    name: str = "h100-od",
    model: AcceleratorModel = H100,
    price: float = 4.0,
    tier: PriceTier = PriceTier.ON_DEMAND,
    max_nodes: int = 8,
    min_nodes: int = 0,
    per_node: int = 8,
) -> NodePool:
    return NodePool(
        name=name,
        cluster=ClusterId("cloud"),
        accelerator=model,
        accelerators_per_node=per_node,
        cpu=96,
        memory_gb=1024,
        price_tier=tier,
        price=price,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        provision_s=180,
        cooldown_s=600,
    )


def ready(node_id: str, used: float = 0.0, empty_since: float | None = 0.0) -> PoolNode:
    return PoolNode(node_id, requested_at=0.0, ready_at=0.0, used=used, empty_since=empty_since)


def coming(node_id: str) -> PoolNode:
    return PoolNode(node_id, requested_at=90.0)


def test_a_gang_gets_whole_nodes_by_its_shape_not_scattered_gpus() -> None:
    gang = job(8, replicas=4)
    plan = decide([pool()], {}, [Demand(gang)], now=100.0)
    (d,) = plan.decisions
    assert (d.pool, d.add, d.for_jobs) == ("h100-od", 4, (gang.job_id,))
    # Small jobs share the nodes they open: 6 x 3 GPUs need 3 nodes of 8, not 18 GPUs' worth.
    small = [Demand(job(3)) for _ in range(6)]
    assert decide([pool()], {}, small, now=100.0).decisions[0].add == 3


def test_a_gang_that_must_share_one_node_needs_a_node_that_holds_it_all() -> None:
    tight = job(4, replicas=4, topology=TopologyLevel.NODE, required=True)
    plan = decide([pool()], {}, [Demand(tight)], now=100.0)
    assert plan.decisions == [] and plan.unserved[0].reason == "no_pool_fits"
    fits = job(4, replicas=2, topology=TopologyLevel.NODE, required=True)
    assert decide([pool()], {}, [Demand(fits)], now=100.0).decisions[0].add == 1


def test_the_cheapest_pool_per_unit_of_work_wins() -> None:
    # H100 at 4.0 and speed 3 (1.33 per unit) beats A100 at 2.5 and speed 1.5 (1.67).
    pools = [pool("a100", A100, price=2.5), pool("h100", H100, price=4.0)]
    plan = decide(pools, {}, [Demand(job(8))], now=0.0)
    assert [d.pool for d in plan.decisions] == ["h100"]
    # A job that accepts only A100 goes there.
    plan = decide(pools, {}, [Demand(job(8, types=("A100",)))], now=0.0)
    assert [d.pool for d in plan.decisions] == ["a100"]


def test_spot_only_for_preemptible_work() -> None:
    pools = [pool("spot", price=1.0, tier=PriceTier.SPOT), pool("od", price=4.0)]
    assert decide(pools, {}, [Demand(job(8))], now=0.0).decisions[0].pool == "spot"
    firm = job(8, preemptible=False)
    assert decide(pools, {}, [Demand(firm)], now=0.0).decisions[0].pool == "od"
    only_spot = decide([pools[0]], {}, [Demand(firm)], now=0.0)
    assert only_spot.decisions == [] and only_spot.unserved[0].reason == "spot_not_allowed"


def test_capacity_on_its_way_is_not_bought_twice() -> None:
    """A restart or the next decision sees the nodes it asked for as provisioning, and the
    same waiting gang takes them instead of buying more."""
    gang = job(8, replicas=2)
    first = decide([pool()], {}, [Demand(gang)], now=0.0)
    assert first.decisions[0].add == 2
    nodes = {"h100-od": [coming("x-0"), coming("x-1")]}
    again = decide([pool()], nodes, [Demand(gang)], now=30.0)
    assert again.decisions == [] and again.matched == {gang.job_id: "h100-od"}
    # An empty ready node is used before a new one is bought.
    nodes = {"h100-od": [ready("x-0", empty_since=25.0)]}
    plan = decide([pool()], nodes, [Demand(gang)], now=30.0)
    assert plan.decisions[0].add == 1


def test_pool_maximum_and_tenant_budget_bound_the_demand() -> None:
    big = job(8, replicas=3)
    plan = decide([pool(max_nodes=2)], {}, [Demand(big)], now=0.0)
    assert plan.decisions == [] and plan.unserved[0].reason == "pool_max"
    blocked = decide([pool()], {}, [Demand(job(8), budget_blocked=True)], now=0.0)
    assert blocked.decisions == [] and blocked.unserved[0].reason == "tenant_budget"


def test_the_spend_limit_stops_buying_and_names_the_jobs_left_out() -> None:
    # One node of 8 H100 at 4.0 costs 32/h; 40/h are allowed with 0 spent: one node, not two.
    first, second = job(8, tenant="vision"), job(8, tenant="nlp")
    limit = SpendLimit(max_per_hour=40.0, current_per_hour=0.0)
    plan = decide([pool()], {}, [Demand(first), Demand(second)], now=0.0, spend=limit)
    assert plan.decisions[0].add == 1 and plan.decisions[0].for_jobs == (first.job_id,)
    (left,) = plan.unserved
    assert (left.job_id, left.tenant, left.reason) == (second.job_id, "nlp", "cloud_budget")


def test_only_empty_nodes_past_the_cooldown_go_and_never_below_the_minimum() -> None:
    nodes = {
        "h100-od": [
            ready("x-0", used=8.0, empty_since=None),  # busy
            ready("x-1", empty_since=500.0),  # empty for 500 s: not yet
            ready("x-2", empty_since=100.0),  # empty 900 s
            ready("x-3", empty_since=50.0),  # empty 950 s
        ]
    }
    plan = decide([pool(min_nodes=3)], nodes, [], now=1000.0)
    assert plan.decisions[0].remove == ("x-3",)  # the most idle; the minimum keeps x-2
    plan = decide([pool()], nodes, [], now=1000.0)
    assert plan.decisions[0].remove == ("x-3", "x-2")


def test_an_idle_node_waiting_demand_fits_is_kept() -> None:
    nodes = {"h100-od": [ready("x-0", empty_since=0.0)]}
    plan = decide([pool()], nodes, [Demand(job(4))], now=10_000.0)
    assert plan.decisions == []


def test_a_pool_below_its_minimum_is_filled_up() -> None:
    plan = decide([pool(min_nodes=2)], {}, [], now=0.0)
    assert plan.decisions[0].add == 2 and "minimum" in plan.decisions[0].reason


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.5, 1, 2, 4, 8]),
            st.integers(1, 6),
            st.booleans(),
        ),
        max_size=25,
    ),
    st.integers(0, 6),
    st.integers(0, 12),
)
def test_decisions_stay_within_limits_and_buy_only_what_the_demand_can_use(
    shapes: list[tuple[float, int, bool]], existing: int, max_nodes: int
) -> None:
    p = pool(max_nodes=max_nodes)
    nodes = {p.name: [coming(f"x-{i}") for i in range(min(existing, max_nodes))]}
    demand = [Demand(job(g, replicas=r, preemptible=pre)) for g, r, pre in shapes]
    plan = decide([p], nodes, demand, now=0.0)
    added = sum(d.add for d in plan.decisions)
    assert len(nodes[p.name]) + added <= max(max_nodes, 0)
    # Every job is matched or said why not, once.
    matched, unserved = set(plan.matched), {u.job_id for u in plan.unserved}
    assert matched.isdisjoint(unserved)
    assert matched | unserved == {d.job.job_id for d in demand}
    # No new node is bought that the matched work could do without: the matched
    # accelerators need at least (nodes - 1) full nodes' worth beyond what was there.
    need = sum(d.job.total_accelerators for d in demand if d.job.job_id in matched)
    if added:
        assert need > (len(nodes[p.name]) + added - 1) * p.accelerators_per_node - 1e-9


def test_a_pool_may_not_take_a_node_groups_name() -> None:
    import pytest

    from core.errors import FleetError
    from core.fleet import load_pools

    doc = {
        "clusters": [
            {
                "name": "c",
                "prices": {"H100": {"on_demand": 4.0}},
                "node_groups": [{"prefix": "h100", "count": 1, "accelerator_type": "H100"}],
                "node_pools": [{"name": "h100", "accelerator_type": "H100", "max_nodes": 2}],
            }
        ]
    }
    with pytest.raises(FleetError, match="collide"):
        load_pools(doc, MODELS)
    doc["clusters"][0]["node_pools"][0]["name"] = "burst"  # type: ignore[index]
    (p,) = load_pools(doc, MODELS)["c"]  # type: ignore[index]
    assert (p.name, p.price, p.max_nodes) == ("burst", 4.0, 2)
