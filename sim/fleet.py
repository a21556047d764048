"""Fleets for the simulator: the YAML fleet file (parsed by `core.fleet.load_fleet`) or a
uniform pool written as NODESxACCELERATORS, e.g. 64x8."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from core.fleet import load_fleet
from core.model import Cluster, ClusterId, Node, NodeId
from core.policy import Policy

Fleet = tuple[dict[ClusterId, Cluster], dict[NodeId, Node]]


def read_fleet(path: Path, policy: Policy) -> Fleet:
    doc: Mapping[str, Any] = yaml.safe_load(path.read_text())
    return load_fleet(doc, policy.accelerator_types)


def pool_doc(spec: str, accelerator_type: str = "GPU") -> dict[str, Any]:
    """One cluster of identical nodes; racks of 8 nodes, blocks of 4 racks."""
    nodes, _, per_node = spec.lower().partition("x")
    if not nodes.isdigit() or not per_node.isdigit():
        raise ValueError(f"pool {spec!r}: expected NODESxACCELERATORS, e.g. 64x8")
    group = {
        "prefix": "gpu",
        "count": int(nodes),
        "accelerator_type": accelerator_type,
        "accelerators_per_node": int(per_node),
        "nodes_per_rack": 8,
        "racks_per_block": 4,
    }
    return {
        "clusters": [{"name": "pool", "location": "sim", "kind": "on_prem", "node_groups": [group]}]
    }


def pool_fleet(spec: str, policy: Policy) -> Fleet:
    return load_fleet(pool_doc(spec), policy.accelerator_types)
