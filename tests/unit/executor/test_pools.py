"""The simulated fleet's elastic pools (services/executor/pools.py): a decision sets a size;
nodes join after the provisioning delay or stock out; only empty named nodes go; node ids
are never reused."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from core.autoscale import NodePool
from core.model import AcceleratorModel, ClusterId, PriceTier
from schemas.events import AutoscaleDecided, PoolNodeState
from services.executor.pools import PoolBook

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def pools(stockout: float = 0.0, minimum: int = 0) -> list[NodePool]:
    return [
        NodePool(
            name="burst",
            cluster=ClusterId("cloud"),
            accelerator=AcceleratorModel("A100", "ampere", 40, 1.6),
            accelerators_per_node=8,
            cpu=96,
            memory_gb=1152,
            price_tier=PriceTier.ON_DEMAND,
            price=2.9,
            min_nodes=minimum,
            max_nodes=4,
            provision_s=180,
            cooldown_s=600,
            stockout_rate=stockout,
        )
    ]


def decided(size: int, remove: tuple[str, ...] = ()) -> AutoscaleDecided:
    return AutoscaleDecided(cluster="cloud", pool="burst", desired_nodes=size, remove=list(remove))


def idle(_node_id: str) -> bool:
    return False


def test_nodes_join_after_the_provisioning_delay_in_fleet_time() -> None:
    book = PoolBook("cloud", pools(), time_scale=60.0)
    change = book.apply(decided(2), T0, idle)
    assert [m.node_id for m in change.asked] == ["cloud-burst-0000", "cloud-burst-0001"]
    assert book.due(T0 + timedelta(seconds=2.9)).joined == []  # 180 fleet s = 3 s at 60x
    joined = book.due(T0 + timedelta(seconds=3)).joined
    assert len(joined) == 2 and sorted(book.ready_nodes()) == [
        "cloud-burst-0000",
        "cloud-burst-0001",
    ]
    node = book.node(joined[0])
    assert (node.accelerators, node.accelerator.type, node.price_tier) == (
        8,
        "A100",
        PriceTier.ON_DEMAND,
    )
    (status,) = book.status(lambda _n: 0.0)
    assert status.desired_nodes == 2 and {n.state for n in status.nodes} == {PoolNodeState.READY}


def test_the_same_decision_twice_buys_nothing_twice_and_the_size_is_bounded() -> None:
    book = PoolBook("cloud", pools(), time_scale=1.0)
    book.apply(decided(2), T0, idle)
    assert book.apply(decided(2), T0, idle).asked == []
    assert len(book.apply(decided(99), T0, idle).asked) == 2  # max 4
    assert len(book.members) == 4


def test_only_empty_named_nodes_go_and_a_busy_one_counts_on_top_of_the_size() -> None:
    book = PoolBook("cloud", pools(), time_scale=1.0)
    book.apply(decided(2), T0, idle)
    book.due(T0 + timedelta(seconds=180))
    book.apply(decided(3), T0 + timedelta(seconds=200), idle)  # a third one on its way

    def busy(node_id: str) -> bool:
        return node_id == "cloud-burst-0000"

    # Taken on an inventory that showed 0000 and 0001 empty and 0002 coming: keep 1.
    change = book.apply(decided(1, ("cloud-burst-0000", "cloud-burst-0001")), T0, busy)
    # 0000 took work meanwhile and stays, on top of the size: 0002 (bought for a waiting
    # job) is not canceled in its place.
    assert [m.node_id for m in change.dropped] == ["cloud-burst-0001"]
    assert sorted(book.members) == ["cloud-burst-0000", "cloud-burst-0002"]
    # Node numbers are never reused.
    assert [m.node_id for m in book.apply(decided(3), T0, busy).asked] == ["cloud-burst-0003"]


def test_provisioning_beyond_the_size_is_canceled_unless_asked_after_the_decisions_inventory() -> (
    None
):
    book = PoolBook("cloud", pools(), time_scale=1.0)
    book.apply(decided(1), T0, idle)
    book.apply(decided(2), T0 + timedelta(seconds=10), idle)
    late = decided(0)
    late.inventory_at = T0 + timedelta(seconds=5)  # it saw only the first request
    change = book.apply(late, T0 + timedelta(seconds=20), idle)
    assert [m.node_id for m in change.dropped] == ["cloud-burst-0000"]
    assert sorted(book.members) == ["cloud-burst-0001"]


def test_a_stockout_drops_the_request_and_says_so_until_a_node_comes() -> None:
    book = PoolBook("cloud", pools(stockout=1.0), time_scale=1.0, seed=1)
    book.apply(decided(1), T0, idle)
    change = book.due(T0 + timedelta(seconds=180))
    assert change.joined == [] and len(change.dropped) == 1 and book.members == {}
    (status,) = book.status(lambda _n: 0.0)
    assert status.failing is not None and "stockout" in status.failing
    ok = PoolBook("cloud", pools(), time_scale=1.0)
    ok.failing["burst"] = ("stockout", T0)
    ok.apply(decided(1), T0, idle)
    ok.due(T0 + timedelta(seconds=180))
    assert "burst" not in ok.failing


def test_restore_keeps_members_sizes_and_numbering() -> None:
    book = PoolBook("cloud", pools(), time_scale=1.0)
    book.apply(decided(2), T0, idle)
    again = PoolBook("cloud", pools(), time_scale=1.0)
    again.restore(list(book.members.values()), {"burst": (2, 5)})
    assert sorted(again.members) == sorted(book.members) and again.desired["burst"] == 2
    assert [m.node_id for m in again.apply(decided(3), T0, idle).asked] == ["cloud-burst-0005"]


def test_a_decision_older_than_one_applied_is_not_applied() -> None:
    """A consumer group replaying from an old offset reads an old decision again: its size
    and its removals are stale, and it changes nothing."""
    book = PoolBook("cloud", pools(), time_scale=1.0)
    book.apply(decided(2), T0, idle, decided_at=T0 + timedelta(seconds=10))
    assert book.apply(decided(4), T0, idle, decided_at=T0 + timedelta(seconds=5)).asked == []
    assert len(book.members) == 2 and book.desired["burst"] == 2
    again = PoolBook("cloud", pools(), time_scale=1.0)
    again.restore(list(book.members.values()), {"burst": (2, 2)}, dict(book.applied_at))
    assert again.apply(decided(4), T0, idle, decided_at=T0 + timedelta(seconds=5)).asked == []
