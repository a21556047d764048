"""The autoscaler service's planner: what it reads from the log becomes pool sizes; nothing is
decided on an inventory older than the process (restart safety), the same decision is not
repeated, spent budgets and paused pools grow nothing, empty nodes go after the cool-down."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from core.autoscale import NodePool
from core.model import AcceleratorModel, ClusterId, PriceTier
from schemas.events import (
    CapacityDemand,
    ClusterCapacity,
    DemandItem,
    PoolNode,
    PoolNodeState,
    PoolStatus,
)
from schemas.usage import BudgetExceeded, BudgetUnit, Enforcement
from services.autoscaler.planner import MonthlySpend, Planner

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
A100 = AcceleratorModel("A100", "ampere", 40, 1.6)


def pool(
    name: str = "burst", price: float = 2.9, tier: PriceTier = PriceTier.ON_DEMAND
) -> NodePool:
    return NodePool(
        name=name,
        cluster=ClusterId("cloud"),
        accelerator=A100,
        accelerators_per_node=8,
        cpu=96,
        memory_gb=1152,
        price_tier=tier,
        price=price,
        max_nodes=4,
        cooldown_s=600,
    )


def status(name: str = "burst", nodes: list[PoolNode] | None = None, **extra: object) -> PoolStatus:
    return PoolStatus(
        pool=name,
        accelerator_type="A100",
        accelerators_per_node=8,
        price_tier="on_demand",
        min_nodes=0,
        max_nodes=4,
        desired_nodes=len(nodes or []),
        nodes=nodes or [],
        **extra,  # type: ignore[arg-type]
    )


def capacity(*pools: PoolStatus) -> ClusterCapacity:
    return ClusterCapacity(
        cluster="cloud", location="x", kind="cloud", prices={}, nodes=[], pools=list(pools)
    )


def demand(*items: DemandItem, epoch: int = 1) -> CapacityDemand:
    return CapacityDemand(scheduler="s", epoch=epoch, jobs=list(items), pending_jobs=len(items))


def gang(job_id: str = "g1", tenant: str = "vision", replicas: int = 2) -> DemandItem:
    return DemandItem(
        job_id=job_id,
        tenant=tenant,
        replicas=replicas,
        accelerators=8,
        accelerator_types=["A100"],
        codes=["insufficient_capacity"],
    )


def planner(*pools: NodePool) -> Planner:
    return Planner(list(pools) or [pool()], time_scale=1.0, started_at=T0)


def test_nothing_is_decided_on_an_inventory_from_before_the_start() -> None:
    p = planner()
    p.on_demand(demand(gang()), T0)
    p.on_capacity(capacity(status()), T0 - timedelta(seconds=5))
    assert p.plan(T0 + timedelta(seconds=1)).decisions == []
    p.on_capacity(capacity(status()), T0 + timedelta(seconds=2))
    (d,) = p.plan(T0 + timedelta(seconds=3)).decisions
    assert (d.cluster, d.pool, d.desired_nodes, d.for_jobs) == ("cloud", "burst", 2, ["g1"])


def test_a_decision_is_not_repeated_and_nodes_on_their_way_are_not_bought_again() -> None:
    p = planner()
    p.on_demand(demand(gang()), T0)
    p.on_capacity(capacity(status()), T0)
    assert len(p.plan(T0).decisions) == 1
    assert p.plan(T0 + timedelta(seconds=5)).decisions == []  # the executor has not shown it
    coming = [
        PoolNode(node_id=f"cloud-burst-000{i}", state=PoolNodeState.PROVISIONING, requested_at=T0)
        for i in range(2)
    ]
    p.on_capacity(capacity(status(nodes=coming)), T0 + timedelta(seconds=6))
    assert p.plan(T0 + timedelta(seconds=60)).decisions == []


def test_a_spent_budget_grows_nothing() -> None:
    p = planner()
    p.on_budget(
        BudgetExceeded(
            budget_id="b",
            tenant="vision",
            month="2026-03",
            unit=BudgetUnit.CURRENCY,
            limit=100,
            used=100,
            threshold_pct=100,
            enforcement=Enforcement.BLOCK,
            crossed_at=T0,
            message="spent",
        )
    )
    p.on_demand(demand(gang(tenant="vision"), gang("g2", tenant="nlp", replicas=1)), T0)
    p.on_capacity(capacity(status()), T0)
    plan = p.plan(T0)
    (d,) = plan.decisions
    assert d.for_jobs == ["g2"] and d.desired_nodes == 1
    assert "budget" in plan.unserved["g1"]


def test_a_failing_pool_is_paused_and_the_next_cheapest_takes_the_demand() -> None:
    cheap, dear = pool("cheap", price=2.0), pool("dear", price=4.0)
    p = planner(cheap, dear)
    p.on_demand(demand(gang()), T0)
    failing = status("cheap", failing="stockout: no A100", failed_at=T0)
    p.on_capacity(capacity(failing, status("dear")), T0)
    plan = p.plan(T0 + timedelta(seconds=10))
    assert [d.pool for d in plan.decisions] == ["dear"]
    assert [i.pool for i in plan.incidents] == ["cheap"]  # one alert per incident
    assert p.plan(T0 + timedelta(seconds=20)).incidents == []
    # After the pause the cheap pool is tried again.
    p.on_demand(demand(gang("g3")), T0 + timedelta(seconds=400))
    p.on_capacity(capacity(failing, status("dear")), T0 + timedelta(seconds=400))
    assert [d.pool for d in p.plan(T0 + timedelta(seconds=401)).decisions] == ["cheap"]


def test_old_demand_grows_nothing() -> None:
    p = planner()
    p.on_demand(demand(gang()), T0)
    p.on_capacity(capacity(status()), T0 + timedelta(seconds=200))
    assert p.plan(T0 + timedelta(seconds=200)).decisions == []


def test_an_empty_node_goes_after_the_cooldown() -> None:
    p = planner()
    idle = PoolNode(
        node_id="cloud-burst-0000",
        state=PoolNodeState.READY,
        requested_at=T0,
        ready_at=T0,
        empty_since=T0,
    )
    busy = PoolNode(
        node_id="cloud-burst-0001",
        state=PoolNodeState.READY,
        requested_at=T0,
        ready_at=T0,
        used=8,
    )
    p.on_capacity(capacity(status(nodes=[idle, busy])), T0 + timedelta(seconds=1))
    assert p.plan(T0 + timedelta(seconds=599)).decisions == []
    (d,) = p.plan(T0 + timedelta(seconds=600)).decisions
    assert (d.desired_nodes, d.remove) == (1, ["cloud-burst-0000"])


def test_inventories_tell_how_long_nodes_took_and_how_long_they_sat_empty() -> None:
    p = planner()
    coming = PoolNode(node_id="n0", state=PoolNodeState.PROVISIONING, requested_at=T0)
    assert p.on_capacity(capacity(status(nodes=[coming])), T0).ready_after_s == []
    ready = PoolNode(
        node_id="n0",
        state=PoolNodeState.READY,
        requested_at=T0,
        ready_at=T0 + timedelta(seconds=180),
        empty_since=T0 + timedelta(seconds=180),
    )
    seen = p.on_capacity(capacity(status(nodes=[ready])), T0 + timedelta(seconds=200))
    assert seen.ready_after_s == [180.0] and seen.idle_node_s == 0.0
    seen = p.on_capacity(capacity(status(nodes=[ready])), T0 + timedelta(seconds=230))
    assert seen.ready_after_s == [] and seen.idle_node_s == 30.0
    # An inventory older than the last one (read late) counts nothing.
    assert p.on_capacity(capacity(status(nodes=[ready])), T0).idle_node_s == 0.0


def test_the_cloud_budget_buys_no_gang_it_cannot_pay_for_the_rest_of_the_month() -> None:
    # March has 31 days; from T0 (March 1, 12:00) 731.5 hours are left. A node costs 8 x 2.9
    # = 23.2 per hour: a budget for 1.5 nodes all month cannot buy a 2-node gang, but can buy
    # a 1-node job; one for 2.5 nodes buys the gang.
    node_month = 23.2 * 731.5
    for budget, bought in ((1.5 * node_month, ["g2"]), (2.5 * node_month, ["g1"])):
        p = Planner([pool()], time_scale=1.0, started_at=T0, cloud_budget_per_month=budget)
        p.on_demand(demand(gang(), gang("g2", replicas=1)), T0)
        p.on_capacity(capacity(status()), T0)
        plan = p.plan(T0)
        assert [j for d in plan.decisions for j in d.for_jobs] == bought
        if bought == ["g2"]:
            assert "budget" in plan.unserved["g1"]


def test_spend_counts_the_pools_rate_in_fleet_time_and_starts_again_each_month() -> None:
    spend = MonthlySpend(budget=1000.0)
    spend.advance(T0, 10.0, time_scale=1.0)
    spend.advance(T0 + timedelta(hours=2), 4.0, time_scale=1.0)
    assert spend.spent == 20.0  # 10 per hour for the two hours before the rate changed
    spend.advance(T0 + timedelta(hours=2, minutes=30), 4.0, time_scale=60.0)
    assert spend.spent == 20.0 + 4.0 * 0.5 * 60  # half a wall hour is 30 fleet hours
    # Across the month's end only the part in the new month counts, from zero.
    april = datetime(2026, 4, 1, 1, 0, tzinfo=UTC)
    spend.advance(april, 4.0, time_scale=1.0)
    assert (spend.month, spend.spent) == ("2026-04", 4.0)
    # What may be spent per hour: the budget left over the hours left in April (719).
    limit = spend.limit(april, time_scale=1.0)
    assert abs(limit.max_per_hour - 996.0 / 719.0) < 1e-9
    assert limit.current_per_hour == 4.0
