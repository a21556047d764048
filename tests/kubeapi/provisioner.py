"""A cluster-autoscaler for the double: it answers ProvisioningRequests and removes empty nodes,
as cluster-autoscaler does with the `best-effort-atomic-scale-up` class.

- A new request is `Accepted`. Every `provision_delay` s it is looked at: if its placeholder
  pods (the pod template's nodeSelector names the node group through `pool_label`) fit on
  empty schedulable nodes of the group that the template's `matchFields metadata.name NotIn`
  does not exclude, it is `Provisioned` with reason `CapacityIsFound` and nothing is added;
  else, if the group is out of stock (`stockout(group)`) or would pass its maximum, nothing
  is added and it stays `Provisioned=False` (`CapacityIsNotFound`), to be tried again at the
  next look, as cluster-autoscaler does (it says `Failed` only when a request expires, after
  days); else all the nodes asked are added and it is `Provisioned`.
- A node of a group that is cordoned, not annotated `scale-down-disabled: "true"`, and has no
  pod on it is deleted `scale_down_delay` s later (checked again then).

Install it on the double's loop: `ClusterAutoscaler(double, groups)`; `asked` lists the requests
seen, for assertions."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.kubeapi.kubelet import ClusterHooks, set_condition
from tests.kubeapi.store import Change
from tests.kubeapi.strategies import Obj, ResourceType

REQUESTS = "provisioningrequests.autoscaling.x-k8s.io"
KEEP = "cluster-autoscaler.kubernetes.io/scale-down-disabled"


@dataclass(frozen=True)
class NodeGroup:
    """A node group: its nodes carry `labels` (with the pool label) and offer `allocatable`."""

    name: str
    labels: dict[str, str]
    allocatable: dict[str, str]
    max_nodes: int = 100


@dataclass
class Asked:
    name: str
    group: str
    count: int
    outcome: str = "pending"  # provisioned | found | waiting
    nodes: list[str] = field(default_factory=list)
    # The pod template's spec as it was when the request came (both go once it is met).
    template: Obj = field(default_factory=dict)


class ClusterAutoscaler:
    def __init__(
        self,
        double: ClusterHooks,
        groups: Sequence[NodeGroup],
        *,
        pool_label: str = "quartermaster.io/pool",
        provision_delay: float = 1.5,
        scale_down_delay: float = 0.5,
        stockout: Callable[[str], bool] = lambda group: False,
    ) -> None:
        self.double = double
        self.groups = {g.name: g for g in groups}
        self.pool_label = pool_label
        self.provision_delay = provision_delay
        self.scale_down_delay = scale_down_delay
        self.stockout = stockout
        self.asked: list[Asked] = []
        self.removed: list[str] = []
        self._made: dict[str, int] = {}
        self._loop = asyncio.get_running_loop()
        self._doomed: set[str] = set()
        double.add_listener(self._on_change)

    def _on_change(self, rt: ResourceType, change: Change) -> None:
        if rt.key == REQUESTS and change.type == "ADDED":
            meta = change.obj["metadata"]
            self._loop.call_soon(self._accept, meta["namespace"], meta["name"], meta["uid"])
        elif rt.key in ("nodes", "pods"):
            self._loop.call_soon(self._look_for_empty)

    def _accept(self, namespace: str, name: str, uid: str) -> None:
        pr = self.double.find(REQUESTS, namespace, name)
        if pr is None or pr["metadata"]["uid"] != uid:
            return
        group, count, template = self._wanted(namespace, pr)
        self.asked.append(Asked(name, group, count, template=template))
        status: Obj = {}
        set_condition(status, "Accepted", "True", "Accepted", "ProvisioningRequest is accepted")
        self.double.set_status(REQUESTS, namespace, name, status)
        self._loop.call_later(self.provision_delay, self._provision, namespace, name, uid)

    def _wanted(self, namespace: str, pr: Obj) -> tuple[str, int, Obj]:
        count, group, first = 0, "", {}
        for pod_set in (pr.get("spec") or {}).get("podSets") or []:
            count += int(pod_set.get("count") or 0)
            ref = (pod_set.get("podTemplateRef") or {}).get("name", "")
            template = self.double.find("podtemplates", namespace, ref) or {}
            spec = ((template.get("template") or {}).get("spec")) or {}
            group = group or (spec.get("nodeSelector") or {}).get(self.pool_label, "")
            first = first or spec
        return group, count, first

    def _provision(self, namespace: str, name: str, uid: str) -> None:
        pr = self.double.find(REQUESTS, namespace, name)
        if pr is None or pr["metadata"]["uid"] != uid:
            return  # deleted meanwhile: canceled
        asked = next(a for a in self.asked if a.name == name)
        group = self.groups.get(asked.group)
        status = dict(pr.get("status") or {})
        if group is not None and self._found(group.name, asked):
            set_condition(status, "Provisioned", "True", "CapacityIsFound", "capacity is found")
            asked.outcome = "found"
        elif group is None or self.stockout(asked.group):
            why = (
                f"no node group matches pool {asked.group!r}"
                if group is None
                else f"stockout: node group {asked.group} has no capacity in its zone"
            )
            set_condition(status, "Provisioned", "False", "CapacityIsNotFound", why)
            asked.outcome = "waiting"
        elif self._size(group.name) + asked.count > group.max_nodes:
            why = f"node group {group.name} would pass its maximum of {group.max_nodes} nodes"
            set_condition(status, "Provisioned", "False", "CapacityIsNotFound", why)
            asked.outcome = "waiting"
        else:
            for _ in range(asked.count):
                seq = self._made.get(group.name, 0)
                self._made[group.name] = seq + 1
                node = f"{group.name}-{seq:04d}"
                labels = {**group.labels, self.pool_label: group.name}
                self.double.add_node(node, labels=labels, allocatable=group.allocatable)
                asked.nodes.append(node)
            set_condition(status, "Provisioned", "True", "Provisioned", "capacity is available")
            asked.outcome = "provisioned"
        self.double.set_status(REQUESTS, namespace, name, status, merge=False)
        if asked.outcome == "waiting":  # looked at again, as cluster-autoscaler's loop does
            self._loop.call_later(self.provision_delay, self._provision, namespace, name, uid)

    def _found(self, group: str, asked: Asked) -> bool:
        """Whether the placeholders fit on empty, schedulable nodes of the group that the
        template does not exclude (its `metadata.name NotIn` match fields)."""
        excluded: set[str] = set()
        terms = (
            ((asked.template.get("affinity") or {}).get("nodeAffinity") or {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution"
            )
            or {}
        ).get("nodeSelectorTerms") or []
        for term in terms:
            for f in term.get("matchFields") or []:
                if f.get("key") == "metadata.name" and f.get("operator") == "NotIn":
                    excluded |= set(f.get("values") or [])
        free = [
            n
            for n in self.double.objects("nodes")
            if (n["metadata"].get("labels") or {}).get(self.pool_label) == group
            and n["metadata"]["name"] not in excluded
            and not (n.get("spec") or {}).get("unschedulable")
            and not self._pods_on(n["metadata"]["name"])
        ]
        return len(free) >= asked.count

    def _pods_on(self, node: str) -> bool:
        return any(p["spec"].get("nodeName") == node for p in self.double.objects("pods"))

    def _size(self, group: str) -> int:
        return sum(
            1
            for n in self.double.objects("nodes")
            if (n["metadata"].get("labels") or {}).get(self.pool_label) == group
        )

    def _look_for_empty(self) -> None:
        for node in self.double.objects("nodes"):
            name = node["metadata"]["name"]
            if name not in self._doomed and self._removable(node):
                self._doomed.add(name)
                self._loop.call_later(self.scale_down_delay, self._remove, name)

    def _removable(self, node: Obj) -> bool:
        meta: Any = node["metadata"]
        if (meta.get("labels") or {}).get(self.pool_label) not in self.groups:
            return False
        if (meta.get("annotations") or {}).get(KEEP) == "true":
            return False
        if not (node.get("spec") or {}).get("unschedulable"):
            return False
        return not self._pods_on(meta["name"])

    def _remove(self, name: str) -> None:
        self._doomed.discard(name)
        node = self.double.find("nodes", None, name)
        if node is not None and self._removable(node):
            self.double.delete_node(name)
            self.removed.append(name)
