"""Tiers and prices follow each cluster's newest inventory: a node re-tiered is billed at its
new tier, a node no inventory lists any more is forgotten, a node that moved is priced by its
new cluster, and the fleet file still wins over what an executor announces."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schemas.events import ClusterCapacity, NodeInfo, ReplicaAssignment
from services.meter.pricing import DEFAULT_TIER, MAX_DEPARTED, Announced, PriceBook
from services.meter.ticks import micros


def node(node_id: str, tier: str, accelerators: int = 8) -> NodeInfo:
    return NodeInfo(
        node_id=node_id, block="b", rack="r", nvlink_domain="n", accelerator_type="A100",
        generation="ampere", accelerator_memory_gb=80, relative_speed=1,
        accelerators=accelerators, cpu=64, memory_gb=512, price_tier=tier,
    )  # fmt: skip


def inventory(cluster: str, *nodes: NodeInfo, spot: float = 0.9) -> ClusterCapacity:
    return ClusterCapacity(
        cluster=cluster,
        location="eu",
        kind="cloud",
        prices={"A100": {"spot": spot, "on_demand": 3.0}},
        nodes=list(nodes),
    )


def tiers_billed(book: PriceBook, cluster: str, *node_ids: str) -> list[tuple[str, int, int]]:
    replicas = [
        ReplicaAssignment(replica=i, node_id=n, accelerators=1, cpu=1, memory_gb=1)
        for i, n in enumerate(node_ids)
    ]
    shares = book.shares(cluster, "A100", replicas)
    return [(s.price_tier, s.count_u, s.unit_price_u) for s in shares]


def test_a_node_is_billed_at_the_tier_of_its_clusters_newest_inventory() -> None:
    book = PriceBook()
    book.learn(inventory("cloud", node("x", "spot")))
    assert tiers_billed(book, "cloud", "x") == [("spot", micros(1), micros("0.9"))]
    # The pool's spot capacity was converted to on-demand: billed as on-demand from now on.
    pools = book.learn(inventory("cloud", node("x", "on_demand")))
    assert tiers_billed(book, "cloud", "x") == [("on_demand", micros(1), micros(3))]
    assert [(p.price_tier, p.accelerators) for p in pools] == [("on_demand", 8)]


def test_a_node_no_inventory_lists_leaves_the_clusters_tiers() -> None:
    book = PriceBook()
    book.learn(inventory("cloud", *(node(f"s-{i}", "spot") for i in range(100))))
    book.learn(inventory("cloud", node("s-100", "spot")))  # an elastic pool replaced its nodes
    assert dict(book.announced["cloud"].tiers) == {"s-100": "spot"}  # bounded by the fleet
    assert len(book.departed) == 100  # their last tiers, bounded by MAX_DEPARTED
    assert tiers_billed(book, "elsewhere", "never-listed")[0][0] == DEFAULT_TIER


def test_a_node_that_moved_is_priced_by_its_new_cluster() -> None:
    book = PriceBook()
    book.learn(inventory("a", node("m", "on_demand"), spot=0.5))
    book.learn(inventory("b", node("m", "spot"), spot=0.7))
    book.learn(inventory("a", spot=0.5))  # a's next inventory, without m, comes after b's
    assert tiers_billed(book, "b", "m") == [("spot", micros(1), micros("0.7"))]


def test_the_fleet_file_wins_and_announced_prices_are_replaced() -> None:
    book = PriceBook(
        node_tiers={"r": "reserved"},
        configured={("cloud", "A100", "reserved"): micros("1.5")},
        fallback={("A100", "spot"): micros("0.2")},
    )
    book.learn(inventory("cloud", node("r", "spot"), node("s", "spot"), spot=0.9))
    assert tiers_billed(book, "cloud", "r", "s") == [
        ("reserved", micros(1), micros("1.5")),
        ("spot", micros(1), micros("0.9")),
    ]
    no_prices = ClusterCapacity(
        cluster="cloud", location="eu", kind="cloud", prices={}, nodes=[node("s", "spot")]
    )
    book.learn(no_prices)  # the executor stopped announcing: the policy's price applies
    assert tiers_billed(book, "cloud", "s") == [("spot", micros(1), micros("0.2"))]


names = st.text(min_size=1, max_size=12)


@given(
    prices=st.dictionaries(st.tuples(names, names), st.integers(0, 10**12), max_size=6),
    tiers=st.dictionaries(names, names, max_size=20),
)
def test_what_a_cluster_announced_reads_back_as_it_was_kept(
    prices: dict[tuple[str, str], int], tiers: dict[str, str]
) -> None:
    kept = Announced(prices, tiers)
    assert Announced.from_json(kept.to_json()) == kept


def test_a_departed_nodes_tier_holds_for_a_placement_read_after_the_inventory() -> None:
    """An inventory read ahead of a placement on a node it no longer lists (a backlog reads
    topics in no common order): the node keeps its last tier. The memory of departed nodes
    is bounded, oldest forgotten first."""
    book = PriceBook()
    book.learn(inventory("cloud", node("gone", "spot"), node("stays", "spot")))
    book.learn(inventory("cloud", node("stays", "spot")))
    assert tiers_billed(book, "cloud", "gone")[0][0] == "spot"
    book.learn(inventory("cloud", node("gone", "reserved"), node("stays", "spot")))
    assert "gone" not in book.departed  # listed again: its new tier is the cluster's
    assert tiers_billed(book, "cloud", "gone")[0][0] == "reserved"

    many = PriceBook()
    many.learn(inventory("cloud", *(node(f"n{i}", "spot") for i in range(MAX_DEPARTED + 5))))
    many.learn(inventory("cloud"))
    assert len(many.departed) == MAX_DEPARTED
    assert "n0" not in many.departed and f"n{MAX_DEPARTED + 4}" in many.departed
