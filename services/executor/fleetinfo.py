"""This cluster's inventory as the events the scheduler and health service read."""

from __future__ import annotations

from core.model import Cluster, Node
from schemas.events import ClusterCapacity, NodeHeartbeat, NodeInfo, PoolStatus
from services.executor.nodes import NodeBook


def capacity_event(
    cluster: Cluster, nodes: dict[str, Node], pools: list[PoolStatus] | None = None
) -> ClusterCapacity:
    prices: dict[str, dict[str, float]] = {}
    for (acc_type, tier), price in cluster.prices.items():
        prices.setdefault(acc_type, {})[tier.value] = price
    return ClusterCapacity(
        cluster=cluster.cluster_id,
        location=cluster.location,
        kind=cluster.kind.value,
        prices=prices,
        nodes=[
            NodeInfo(
                node_id=n.node_id,
                block=n.block,
                rack=n.rack,
                nvlink_domain=n.nvlink_domain,
                accelerator_type=n.accelerator.type,
                generation=n.accelerator.generation,
                accelerator_memory_gb=n.accelerator.memory_gb,
                relative_speed=n.accelerator.relative_speed,
                accelerators=n.accelerators,
                cpu=n.cpu,
                memory_gb=n.memory_gb,
                price_tier=n.price_tier.value,
                healthy=n.healthy,
            )
            for n in sorted(nodes.values(), key=lambda n: n.node_id)
        ],
        pools=pools or [],
    )


def heartbeats(cluster: str, book: NodeBook) -> list[NodeHeartbeat]:
    return [
        NodeHeartbeat(
            node_id=node_id,
            cluster=cluster,
            healthy=use.node.healthy,
            accelerators=use.node.accelerators,
            allocated_accelerators=round(use.allocated_accelerators, 6),
        )
        for node_id, use in sorted(book.use.items())
    ]
