"""Prices and price tiers: what one accelerator-hour of a placement costs, and the fleet's
inventory per pool (cluster, accelerator type, tier) that idle capacity is measured against.

Where a price comes from, first found wins: the cluster's `prices` in the fleet file, the
prices the cluster's executor announced on `cluster.capacity`, the policy file's `prices`.
A node's tier comes from its node group in the fleet file, else from `cluster.capacity`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.fleet import load_fleet
from core.policy import Policy
from schemas.events import ClusterCapacity, ReplicaAssignment
from services.meter.ticks import Share, micros

DEFAULT_TIER = "on_demand"
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


@dataclass
class PriceBook:
    node_tiers: dict[str, str] = field(default_factory=dict)
    # prices per accelerator-hour, in millionths
    configured: dict[PriceKey, int] = field(default_factory=dict)
    announced: dict[PriceKey, int] = field(default_factory=dict)
    fallback: dict[tuple[str, str], int] = field(default_factory=dict)
    unpriced: set[PriceKey] = field(default_factory=set)

    def tier(self, node_id: str) -> str:
        return self.node_tiers.get(node_id, DEFAULT_TIER)

    def price(self, cluster: str, accelerator_type: str, tier: str) -> int:
        key = (cluster, accelerator_type, tier)
        for table in (self.configured, self.announced):
            if key in table:
                return table[key]
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
            counts[self.tier(r.node_id)] += micros(r.accelerators)
        return tuple(
            Share(tier, count, self.price(cluster, accelerator_type, tier))
            for tier, count in sorted(counts.items())
        )

    def learn(self, capacity: ClusterCapacity) -> list[Pool]:
        """Take in an executor's inventory; return the cluster's pools."""
        for type_name, tiers in capacity.prices.items():
            for tier, price in tiers.items():
                self.announced[(capacity.cluster, type_name, tier)] = micros(price)
        totals: dict[tuple[str, str], int] = defaultdict(int)
        for node in capacity.nodes:
            self.node_tiers.setdefault(node.node_id, node.price_tier)
            tier = self.tier(node.node_id)
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
