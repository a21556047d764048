"""Turns a fleet document (the YAML of examples/fleet.yaml, already parsed) into clusters and
nodes. Pure: the caller reads the file. Node ids are `<cluster>-<prefix>-<index:04d>`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from core.autoscale import NodePool
from core.errors import FleetError, PolicyError
from core.model import (
    AcceleratorModel,
    Cluster,
    ClusterId,
    ClusterKind,
    Node,
    NodeId,
    PriceTier,
)
from core.policy import price_per_hour

_GROUP_KEYS = {
    "prefix",
    "count",
    "accelerator_type",
    "accelerators_per_node",
    "cpu",
    "memory_gb",
    "price_tier",
    "nodes_per_rack",
    "racks_per_block",
    "nvlink_domain_size",
    "generation",
    "accelerator_memory_gb",
    "relative_speed",
}


# A node group's size and a node's devices (the wire's bound on a node, schemas.events
# ReplicaAssignment.devices, is 4,096 devices; a group of more nodes is a typo, and would be
# built in memory by every service that loads the file).
MAX_GROUP_NODES = 100_000
MAX_NODE_DEVICES = 4096


def load_fleet(
    doc: Mapping[str, Any],
    accelerator_types: Mapping[str, AcceleratorModel] | None = None,
) -> tuple[dict[ClusterId, Cluster], dict[NodeId, Node]]:
    """Clusters and nodes described by `doc`; `accelerator_types` (usually
    `Policy.accelerator_types`) supplies generation, memory and speed for each type name."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("clusters"), list):
        raise FleetError("fleet: expected a top-level 'clusters' list")
    clusters: dict[ClusterId, Cluster] = {}
    nodes: dict[NodeId, Node] = {}
    for i, raw in enumerate(doc["clusters"]):
        cluster = _cluster(raw, f"clusters[{i}]")
        if cluster.cluster_id in clusters:
            raise FleetError(f"clusters[{i}]: duplicate cluster {cluster.cluster_id!r}")
        clusters[cluster.cluster_id] = cluster
        for j, group in enumerate(raw.get("node_groups", [])):
            where = f"clusters[{i}].node_groups[{j}]"
            for node in _group_nodes(cluster.cluster_id, group, where, accelerator_types or {}):
                if node.node_id in nodes:
                    raise FleetError(f"{where}: duplicate node id {node.node_id!r}")
                nodes[node.node_id] = node
    return clusters, nodes


def _cluster(raw: Any, where: str) -> Cluster:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
        raise FleetError(f"{where}: expected a mapping with a 'name'")
    try:
        kind = ClusterKind(raw.get("kind", "on_prem"))
    except ValueError:
        raise FleetError(f"{where}.kind: {raw.get('kind')!r} is not a cluster kind") from None
    prices: dict[tuple[str, PriceTier], float] = {}
    for type_name, tiers in (raw.get("prices") or {}).items():
        if not isinstance(tiers, Mapping):
            raise FleetError(f"{where}.prices.{type_name}: expected tier: price pairs")
        for tier, price in tiers.items():
            key = (str(type_name), _tier(tier, f"{where}.prices.{type_name}"))
            try:
                prices[key] = price_per_hour(price, f"{where}.prices.{type_name}.{tier}")
            except PolicyError as exc:
                raise FleetError(str(exc)) from None
    return Cluster(ClusterId(raw["name"]), str(raw.get("location", "")), kind, prices)


def _group_nodes(
    cluster: ClusterId,
    group: Any,
    where: str,
    known_types: Mapping[str, AcceleratorModel],
) -> list[Node]:
    if not isinstance(group, Mapping):
        raise FleetError(f"{where}: expected a mapping")
    unknown = sorted(set(group) - _GROUP_KEYS)
    if unknown:
        raise FleetError(f"{where}: unknown key(s) {unknown}")
    prefix = str(group.get("prefix", "node"))
    count = _whole(group.get("count"), f"{where}.count", MAX_GROUP_NODES)
    per_node = _whole(
        group.get("accelerators_per_node", 8), f"{where}.accelerators_per_node", MAX_NODE_DEVICES
    )
    per_rack = max(1, _whole(group.get("nodes_per_rack", 8), f"{where}.nodes_per_rack"))
    per_block = max(1, _whole(group.get("racks_per_block", 8), f"{where}.racks_per_block"))
    nvlink = max(1, _whole(group.get("nvlink_domain_size", 1), f"{where}.nvlink_domain_size"))
    model = _model(group, where, known_types)
    tier = _tier(group.get("price_tier", "on_demand"), f"{where}.price_tier")
    cpu = _number(group.get("cpu", 64), f"{where}.cpu")
    memory = _number(group.get("memory_gb", 512), f"{where}.memory_gb")
    nodes = []
    for index in range(count):
        rack = index // per_rack
        nodes.append(
            Node(
                node_id=NodeId(f"{cluster}-{prefix}-{index:04d}"),
                cluster=cluster,
                # Topology names carry the prefix so two groups never share a rack by accident.
                block=f"{prefix}-b{rack // per_block}",
                rack=f"{prefix}-r{rack}",
                nvlink_domain=f"{prefix}-nv{index // nvlink}",
                accelerator=model,
                accelerators=per_node,
                cpu=cpu,
                memory_gb=memory,
                price_tier=tier,
            )
        )
    return nodes


def _model(
    group: Mapping[str, Any], where: str, known: Mapping[str, AcceleratorModel]
) -> AcceleratorModel:
    type_name = group.get("accelerator_type")
    if not isinstance(type_name, str) or not type_name:
        raise FleetError(f"{where}.accelerator_type: expected a type name")
    base = known.get(type_name, AcceleratorModel(type_name, "unknown", 0.0, 1.0))
    return AcceleratorModel(
        type=type_name,
        generation=str(group.get("generation", base.generation)),
        memory_gb=_number(
            group.get("accelerator_memory_gb", base.memory_gb), f"{where}.accelerator_memory_gb"
        ),
        relative_speed=_number(
            group.get("relative_speed", base.relative_speed), f"{where}.relative_speed"
        ),
    )


def _tier(value: Any, where: str) -> PriceTier:
    try:
        return PriceTier(value)
    except ValueError:
        raise FleetError(
            f"{where}: {value!r} is not one of {[t.value for t in PriceTier]}"
        ) from None


def _number(value: Any, where: str) -> float:
    """A size, a speed, a rate or a duration: finite and not negative (a NaN would reach the
    executor's inventory, which the wire refuses, and stop it at start with no key named)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value < math.inf  # also NaN
    ):
        raise FleetError(f"{where}: expected a finite number of at least 0, got {value!r}")
    return float(value)


def _whole(value: Any, where: str, most: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < 0
        or (most is not None and value > most)
    ):
        bound = "" if most is None else f" up to {most:,}"
        raise FleetError(f"{where}: expected a non-negative integer{bound}, got {value!r}")
    return value


# A DNS label of at most 40: a Kubernetes label value and part of node and request names.
_POOL_NAME = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,38}[a-z0-9])?")
_POOL_KEYS = {
    "name",
    "accelerator_type",
    "accelerators_per_node",
    "cpu",
    "memory_gb",
    "price_tier",
    "min_nodes",
    "max_nodes",
    "provision_s",
    "cooldown_s",
    "stockout_rate",
    "generation",
    "accelerator_memory_gb",
    "relative_speed",
}


def load_pools(
    doc: Mapping[str, Any],
    accelerator_types: Mapping[str, AcceleratorModel] | None = None,
    fallback_prices: Mapping[tuple[str, PriceTier], float] | None = None,
) -> dict[ClusterId, list[NodePool]]:
    """Each cluster's elastic node pools (`node_pools:` in the fleet file). A pool's price is
    its cluster's for its type and tier, else the policy's (`fallback_prices`)."""
    clusters, _ = load_fleet(doc, accelerator_types)
    pools: dict[ClusterId, list[NodePool]] = {}
    names: set[str] = set()
    for i, raw in enumerate(doc["clusters"]):
        cluster = clusters[ClusterId(raw["name"])]
        prefixes = {
            str(g.get("prefix", "node"))
            for g in raw.get("node_groups") or []
            if isinstance(g, Mapping)
        }
        for j, group in enumerate(raw.get("node_pools") or []):
            where = f"clusters[{i}].node_pools[{j}]"
            pool = _pool(cluster, group, where, accelerator_types or {}, fallback_prices or {})
            if pool.name in names:
                raise FleetError(f"{where}: duplicate pool name {pool.name!r}")
            if pool.name in prefixes:
                raise FleetError(
                    f"{where}: pool {pool.name!r} has the name of a node group's prefix; their "
                    "node ids would collide"
                )
            names.add(pool.name)
            pools.setdefault(cluster.cluster_id, []).append(pool)
    return pools


def _pool(
    cluster: Cluster,
    group: Any,
    where: str,
    known: Mapping[str, AcceleratorModel],
    fallback: Mapping[tuple[str, PriceTier], float],
) -> NodePool:
    if not isinstance(group, Mapping):
        raise FleetError(f"{where}: expected a mapping")
    unknown = sorted(set(group) - _POOL_KEYS)
    if unknown:
        raise FleetError(f"{where}: unknown key(s) {unknown}")
    name = group.get("name")
    if not isinstance(name, str) or not _POOL_NAME.fullmatch(name):
        raise FleetError(
            f"{where}.name: expected a name of at most 40 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit (it labels the pool's nodes)"
        )
    model = _model(group, where, known)
    tier = _tier(group.get("price_tier", "on_demand"), f"{where}.price_tier")
    price = cluster.prices.get((model.type, tier), fallback.get((model.type, tier)))
    if price is None:
        raise FleetError(
            f"{where}: no {tier.value} price for {model.type} in the cluster or the policy"
        )
    minimum = _whole(group.get("min_nodes", 0), f"{where}.min_nodes", MAX_GROUP_NODES)
    maximum = _whole(group.get("max_nodes", 0), f"{where}.max_nodes", MAX_GROUP_NODES)
    if maximum < minimum:
        raise FleetError(f"{where}: max_nodes {maximum} is below min_nodes {minimum}")
    stockout = _number(group.get("stockout_rate", 0.0), f"{where}.stockout_rate")
    if not 0.0 <= stockout <= 1.0:
        raise FleetError(f"{where}.stockout_rate: expected a share between 0 and 1")
    per_node = _whole(
        group.get("accelerators_per_node", 8), f"{where}.accelerators_per_node", MAX_NODE_DEVICES
    )
    if per_node < 1:
        raise FleetError(f"{where}.accelerators_per_node: expected at least 1")
    return NodePool(
        name=name,
        cluster=cluster.cluster_id,
        accelerator=model,
        accelerators_per_node=per_node,
        cpu=_number(group.get("cpu", 64), f"{where}.cpu"),
        memory_gb=_number(group.get("memory_gb", 512), f"{where}.memory_gb"),
        price_tier=tier,
        price=price,
        min_nodes=minimum,
        max_nodes=maximum,
        provision_s=_number(group.get("provision_s", 180), f"{where}.provision_s"),
        cooldown_s=_number(group.get("cooldown_s", 600), f"{where}.cooldown_s"),
        stockout_rate=stockout,
    )
