"""Prices and price tiers: what one accelerator-hour of a placement costs, and the fleet's
inventory per pool (cluster, accelerator type, tier) that idle capacity is measured against.

Where a price comes from, first found wins: the cluster's `prices` in the fleet file, the
prices the cluster's executor announced in its newest `cluster.capacity`, the policy file's
`prices`. A node's tier comes from its node group in the fleet file, else from its cluster's
newest `cluster.capacity` (a node it no longer lists has none there), else `on_demand`.
What each cluster announced is kept in the meter's store (`meter.announced`), so that a
restarted meter prices placements as before without waiting for the next inventory.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.fleet import load_fleet
from core.policy import Policy
from schemas.events import ClusterCapacity, ReplicaAssignment
from services.meter.ticks import Share, micros

DEFAULT_TIER = "on_demand"
MAX_DEPARTED = 100_000
PriceKey = tuple[str, str, str]  # cluster, accelerator type, tier


@dataclass(frozen=True)
class Pool:
    """Accelerators of one type and tier in one cluster, and what an hour of one costs."""

    cluster: str
    accelerator_type: str
    price_tier: str
    accelerators: int
    unit_price_u: int

    @property
    def key(self) -> PriceKey:
        return (self.cluster, self.accelerator_type, self.price_tier)


@dataclass(frozen=True)
class Announced:
    """What one cluster's newest inventory says about prices: the executor's price per
    (accelerator type, tier), in millionths an accelerator-hour, and each node's tier."""

    prices: Mapping[tuple[str, str], int]
    tiers: Mapping[str, str]

    @classmethod
    def of(cls, capacity: ClusterCapacity) -> Announced:
        return cls(
            prices={
                (type_name, tier): micros(price)
                for type_name, tiers in capacity.prices.items()
                for tier, price in tiers.items()
            },
            tiers={node.node_id: node.price_tier for node in capacity.nodes},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "prices": [[t, tier, p] for (t, tier), p in sorted(self.prices.items())],
            "tiers": dict(sorted(self.tiers.items())),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Announced:
        return cls(
            prices={(str(t), str(tier)): int(p) for t, tier, p in doc["prices"]},
            tiers={str(node): str(tier) for node, tier in doc["tiers"].items()},
        )


@dataclass
class PriceBook:
    node_tiers: dict[str, str] = field(default_factory=dict)  # the fleet file's; they win
    # prices per accelerator-hour, in millionths
    configured: dict[PriceKey, int] = field(default_factory=dict)
    fallback: dict[tuple[str, str], int] = field(default_factory=dict)
    # Each cluster's newest inventory, replaced whole by the next one.
    announced: dict[str, Announced] = field(default_factory=dict)
    # The last tier of nodes the newest inventories no longer list, newest last, at most
    # MAX_DEPARTED: a placement read after the inventory that dropped its node (the topics
    # are read in no common order, and a backlog can put an inventory first) keeps the
    # node's tier, and the book still does not grow with the fleet's history.
    departed: OrderedDict[str, str] = field(default_factory=OrderedDict)
    unpriced: set[PriceKey] = field(default_factory=set)

    def tier(self, cluster: str, node_id: str) -> str:
        tier = self.node_tiers.get(node_id)
        if tier is None:
            known = self.announced.get(cluster)
            tier = known.tiers.get(node_id) if known is not None else None
        if tier is None:
            tier = self.departed.get(node_id)
        return DEFAULT_TIER if tier is None else tier

    def price(self, cluster: str, accelerator_type: str, tier: str) -> int:
        key = (cluster, accelerator_type, tier)
        if key in self.configured:
            return self.configured[key]
        known = self.announced.get(cluster)
        if known is not None and (accelerator_type, tier) in known.prices:
            return known.prices[(accelerator_type, tier)]
        if (accelerator_type, tier) in self.fallback:
            return self.fallback[(accelerator_type, tier)]
        self.unpriced.add(key)  # billed at 0 and reported, rather than refusing to meter
        return 0

    def shares(
        self, cluster: str, accelerator_type: str, replicas: list[ReplicaAssignment]
    ) -> tuple[Share, ...]:
        """A placement's accelerators grouped by the price tier of the nodes they are on."""
        counts: dict[str, int] = defaultdict(int)
        for r in replicas:
            counts[self.tier(cluster, r.node_id)] += micros(r.accelerators)
        return tuple(
            Share(tier, count, self.price(cluster, accelerator_type, tier))
            for tier, count in sorted(counts.items())
        )

    def learn(self, capacity: ClusterCapacity) -> list[Pool]:
        """Take in an executor's inventory, in place of the cluster's last one; return the
        cluster's pools."""
        now = Announced.of(capacity)
        before = self.announced.get(capacity.cluster)
        self.announced[capacity.cluster] = now
        for node_id in now.tiers:
            self.departed.pop(node_id, None)
        if before is not None:
            for node_id, tier in before.tiers.items():
                if node_id not in now.tiers:
                    self.departed[node_id] = tier
                    self.departed.move_to_end(node_id)
            while len(self.departed) > MAX_DEPARTED:
                self.departed.popitem(last=False)
        totals: dict[tuple[str, str], int] = defaultdict(int)
        for node in capacity.nodes:
            tier = self.tier(capacity.cluster, node.node_id)
            totals[(node.accelerator_type, tier)] += node.accelerators
        return [
            Pool(capacity.cluster, t, tier, n, self.price(capacity.cluster, t, tier))
            for (t, tier), n in sorted(totals.items())
        ]


def price_book(fleet_doc: Mapping[str, Any], policy: Policy) -> PriceBook:
    clusters, nodes = load_fleet(fleet_doc, policy.accelerator_types)
    return PriceBook(
        node_tiers={str(n.node_id): n.price_tier.value for n in nodes.values()},
        configured={
            (str(c.cluster_id), type_name, tier.value): micros(price)
            for c in clusters.values()
            for (type_name, tier), price in c.prices.items()
        },
        fallback={(t, tier.value): micros(p) for (t, tier), p in policy.prices.items()},
    )
