"""Node objects as this cluster's inventory and health inputs (pure): accelerators by type from
labels and allocatable, topology and price tier from configurable labels, and the conditions a
health service reads (Ready, cordoned, devices gone)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import structlog

from core.model import AcceleratorModel, ClusterId, Node, NodeId, PriceTier
from schemas.bounds import MAX_NODE_DEVICES
from services.executor.kube.pods import HOSTNAME_LABEL

log = structlog.get_logger()

Obj = dict[str, Any]

_SUFFIXES: dict[str, int | Decimal] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([A-Za-z]*)$")


def quantity(text: str | int | float | None) -> Decimal:
    """A Kubernetes quantity ("7500m", "32Gi", "8") as a number; unreadable is 0."""
    match = _QUANTITY.match(str(text if text is not None else "0").strip())
    if match is None or match.group(2) not in ("", *_SUFFIXES):
        return Decimal(0)
    number, suffix = match.groups()
    return Decimal(number) * Decimal(_SUFFIXES.get(suffix, 1))


@dataclass(frozen=True)
class NodeLabels:
    """Where this cluster keeps what the scheduler needs to know about a node."""

    accelerator: str = "quartermaster.io/accelerator"
    nvlink: str = "quartermaster.io/nvlink-domain"
    rack: str = "topology.kubernetes.io/rack"
    block: str = "topology.kubernetes.io/zone"
    price_tier: str = "quartermaster.io/price-tier"
    gpu_resource: str = "nvidia.com/gpu"
    accelerator_resources: Mapping[str, str] | None = None
    quarantine_taint: str = ""
    # Labels a node's pods also select on, with the node's values (when it has them).
    pinned: tuple[str, ...] = ()

    def resource(self, accelerator_type: str) -> str:
        for prefix, name in (self.accelerator_resources or {}).items():
            if accelerator_type.upper().startswith(prefix.upper()):
                return name
        return self.gpu_resource


@dataclass(frozen=True)
class NodeView:
    """One Node object as the executor reads it."""

    name: str
    hostname: str
    node: Node | None  # None: no accelerator label (not a node Quartermaster places on)
    ready: bool
    cordoned: bool
    quarantined: bool
    pinned: Mapping[str, str] = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return self.node.accelerators if self.node is not None else 0


def _ready(obj: Obj) -> bool:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return bool(c.get("status") == "True")
    return False


def node_view(
    obj: Obj, cluster: str, labels: NodeLabels, types: Mapping[str, AcceleratorModel]
) -> NodeView:
    meta = obj.get("metadata") or {}
    name = str(meta.get("name", ""))
    own = meta.get("labels") or {}
    spec = obj.get("spec") or {}
    allocatable = (obj.get("status") or {}).get("allocatable") or {}
    ready = _ready(obj)
    cordoned = bool(spec.get("unschedulable"))
    quarantined = bool(labels.quarantine_taint) and any(
        t.get("key") == labels.quarantine_taint for t in spec.get("taints") or []
    )
    node = None
    acc_type = own.get(labels.accelerator)
    devices = int(quantity(allocatable.get(labels.resource(acc_type)))) if acc_type else 0
    # A device plugin gone wrong can report any count; a node has at most MAX_NODE_DEVICES
    # (the inventory on the wire refuses more, and the executor's device books are sized by
    # it): such a node is not offered at all, rather than stopping the cluster's inventory.
    if acc_type and devices > MAX_NODE_DEVICES:
        log.warning(
            "node reports more devices than a node can have; left out of the inventory",
            node=name,
            devices=devices,
            most=MAX_NODE_DEVICES,
        )
    elif acc_type:
        model = types.get(acc_type) or AcceleratorModel(acc_type, acc_type, 0.0)
        try:
            tier = PriceTier(own.get(labels.price_tier, PriceTier.ON_DEMAND.value))
        except ValueError:
            tier = PriceTier.ON_DEMAND
        node = Node(
            node_id=NodeId(name),
            cluster=ClusterId(cluster),
            block=own.get(labels.block, ""),
            rack=own.get(labels.rack, ""),
            nvlink_domain=own.get(labels.nvlink, name),
            accelerator=model,
            accelerators=devices,
            cpu=float(quantity(allocatable.get("cpu"))),
            memory_gb=round(float(quantity(allocatable.get("memory")) / 2**30), 3),
            price_tier=tier,
            healthy=ready and not cordoned and not quarantined,
        )
    pinned = {k: str(own[k]) for k in labels.pinned if k in own}
    hostname = own.get(HOSTNAME_LABEL, name)
    return NodeView(name, hostname, node, ready, cordoned, quarantined, pinned)


def lost_devices(before: NodeView | None, now: NodeView) -> int:
    """Accelerators the node stopped offering (a device plugin dropping a failed device)."""
    if before is None or before.node is None or now.node is None:
        return 0
    return max(before.devices - now.devices, 0)
