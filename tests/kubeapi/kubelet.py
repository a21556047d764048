"""Hooks through which a test plays the kubelet, the scheduler and the node controllers.

Each hook writes through the store like any other writer, so watches see exactly the MODIFIED
(and DELETED) events a real cluster would send. The pod hooks set end states directly (a pod's
restartPolicy is not applied: `pod_oom_killed` makes the pod Failed even if it would restart).

The optional auto kubelet (`auto_kubelet()`) plays scheduler and kubelet for the tests that want
a cluster that just runs pods: see `ClusterHooks.auto_kubelet`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from tests.kubeapi.patches import merge_patch
from tests.kubeapi.selectors import Requirement
from tests.kubeapi.store import ApiError, ApiStore, Change, ResourceRef
from tests.kubeapi.strategies import Obj, ResourceType, parse_quantity, rfc3339

DEFAULT_ALLOCATABLE = {"cpu": "8", "memory": "32Gi", "pods": "110"}
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
_READY = {
    True: ("True", "KubeletReady", "kubelet is posting ready status"),
    False: ("False", "KubeletNotReady", "container runtime network not ready"),
    None: ("Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status."),
}
_AFFINITY_OPS = {
    "In": "in",
    "NotIn": "notin",
    "Exists": "exists",
    "DoesNotExist": "!exists",
    "Gt": "gt",
    "Lt": "lt",
}


def set_condition(
    status: Obj, kind: str, value: str, reason: str = "", message: str = "", **times: str
) -> None:
    """Set one condition of `status`; lastTransitionTime moves only when the value does."""
    conditions = status.setdefault("conditions", [])
    old = next((c for c in conditions if c.get("type") == kind), None)
    condition: Obj = {"type": kind, "status": value, **times}
    if reason:
        condition["reason"] = reason
    if message:
        condition["message"] = message
    unchanged = old is not None and old.get("status") == value
    kept = old.get("lastTransitionTime") if unchanged and old is not None else None
    condition["lastTransitionTime"] = kept or rfc3339()
    if old is None:
        conditions.append(condition)
    else:
        conditions[conditions.index(old)] = condition


def _containers(pod: Obj) -> list[Obj]:
    return [c for c in (pod.get("spec") or {}).get("containers") or [] if isinstance(c, dict)]


def _container_status(pod: Obj, container: Obj, state: Obj, ready: bool) -> Obj:
    uid = pod["metadata"].get("uid", "")
    return {
        "name": container["name"],
        "image": container.get("image", ""),
        "imageID": "",
        "containerID": f"containerd://{uid.replace('-', '')}{container['name']}",
        "ready": ready,
        "started": "running" in state,
        "restartCount": 0,
        "state": state,
    }


def _terminated(reason: str, exit_code: int, started: str, message: str = "") -> Obj:
    state: Obj = {
        "exitCode": exit_code,
        "reason": reason,
        "startedAt": started,
        "finishedAt": rfc3339(),
    }
    if message:
        state["message"] = message
    return {"terminated": state}


def _requests(pod: Obj) -> dict[str, Decimal]:
    """What the scheduler counts for a pod: the sum of its containers' requests."""
    total: dict[str, Decimal] = {}
    for container in _containers(pod):
        for name, value in ((container.get("resources") or {}).get("requests") or {}).items():
            total[name] = total.get(name, Decimal(0)) + parse_quantity(str(value))
    total["pods"] = Decimal(1)
    return total


def _counts_on_node(pod: Obj | None) -> str | None:
    """The node whose resources `pod` holds, if any."""
    if pod is None:
        return None
    phase = (pod.get("status") or {}).get("phase")
    node = (pod.get("spec") or {}).get("nodeName")
    return node if node and phase not in ("Succeeded", "Failed") else None


def _tolerated(taint: Obj, tolerations: list[Obj]) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        exists = toleration.get("operator", "Equal") == "Exists"
        if not toleration.get("key"):
            if exists:
                return True
            continue
        if toleration["key"] != taint.get("key"):
            continue
        if exists or toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


def _selector_matches(spec: Obj, node: Obj) -> bool:
    """spec.nodeSelector and required node affinity (terms ORed, expressions ANDed)."""
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(key) != value for key, value in (spec.get("nodeSelector") or {}).items()):
        return False
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = affinity.get("nodeSelectorTerms") or []
    return not terms or any(_term_matches(term, labels, node) for term in terms)


def _term_matches(term: Obj, labels: dict[str, str], node: Obj) -> bool:
    fields = {"metadata.name": node["metadata"]["name"]}
    for source, values in (("matchExpressions", labels), ("matchFields", fields)):
        for expression in term.get(source) or []:
            op = _AFFINITY_OPS.get(expression.get("operator", ""), "in")
            requirement = Requirement(expression["key"], op, tuple(expression.get("values") or ()))
            if not requirement.matches(values):
                return False
    return True


def _node_info(name: str) -> Obj:
    # Every field: kubernetes-asyncio's V1NodeSystemInfo refuses a node without one of them.
    return {
        "architecture": "amd64",
        "bootID": f"boot-{name}",
        "containerRuntimeVersion": "containerd://1.7.20",
        "kernelVersion": "6.1.0",
        "kubeProxyVersion": "v1.31.0",
        "kubeletVersion": "v1.31.0",
        "machineID": f"machine-{name}",
        "operatingSystem": "linux",
        "osImage": "Debian GNU/Linux 12 (bookworm)",
        "systemUUID": f"uuid-{name}",
    }


def node_ready(node: Obj | None) -> bool:
    conditions = ((node or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


@dataclass
class AutoKubelet:
    run_delay: float = 0.0
    terminate_delay: float = 0.0
    termination_exit_code: int = 143  # SIGTERM, as a workload that does not trap it exits
    check_fit: bool = True


class ClusterHooks(ApiStore):
    """The store plus the hooks of kubelet, scheduler and node controllers."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._auto: AutoKubelet | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._usage: dict[str, Counter[str]] = {}
        self._sweep_pending = False
        self._pod_ips = 0
        self._node_ips = 0
        self.add_listener(self._on_change)

    # --- nodes --------------------------------------------------------------------------------

    def add_node(
        self,
        name: str,
        labels: dict[str, str] | None = None,
        allocatable: dict[str, str] | None = None,
        capacity: dict[str, str] | None = None,
        taints: list[Obj] | None = None,
        ready: bool | None = True,
        unschedulable: bool = False,
    ) -> Obj:
        """Register a node as its kubelet would: the usual well-known labels (including
        `kubernetes.io/hostname`), allocatable over defaults of 8 CPU, 32Gi, 110 pods."""
        self._node_ips += 1
        allocatable = {**DEFAULT_ALLOCATABLE, **(allocatable or {})}
        status: Obj = {
            "capacity": {**allocatable, **(capacity or {})},
            "allocatable": allocatable,
            "addresses": [
                {
                    "type": "InternalIP",
                    "address": f"10.0.{self._node_ips // 250}.{self._node_ips % 250 + 1}",
                },
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": _node_info(name),
        }
        status_value, reason, message = _READY[ready]
        set_condition(status, "Ready", status_value, reason, message, lastHeartbeatTime=rfc3339())
        spec: Obj = {"taints": list(taints)} if taints else {}
        if unschedulable:
            spec["unschedulable"] = True
        well_known = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        }
        body = {
            "metadata": {"name": name, "labels": {**well_known, **(labels or {})}},
            "spec": spec,
            "status": status,
        }
        return self.create("nodes", None, body)

    def set_node_ready(self, name: str, ready: bool | None = True, taint: bool = True) -> Obj:
        """Ready=True/False/Unknown (None: the kubelet stopped posting). With `taint`, the node
        lifecycle controller's not-ready / unreachable taints follow, as in a real cluster."""

        def change(node: Obj) -> None:
            value, reason, message = _READY[ready]
            set_condition(
                node.setdefault("status", {}),
                "Ready",
                value,
                reason,
                message,
                lastHeartbeatTime=rfc3339(),
            )
            if taint:
                keys = {NOT_READY_TAINT, UNREACHABLE_TAINT}
                spec = node.setdefault("spec", {})
                taints = [t for t in spec.get("taints") or [] if t.get("key") not in keys]
                if ready is not True:
                    key = NOT_READY_TAINT if ready is False else UNREACHABLE_TAINT
                    taints += [
                        {"key": key, "effect": "NoSchedule"},
                        {"key": key, "effect": "NoExecute", "timeAdded": rfc3339()},
                    ]
                _set_taints(node, taints)

        return self.mutate("nodes", None, name, change)

    def cordon_node(self, name: str, unschedulable: bool = True) -> Obj:
        """`kubectl cordon` plus the controller's `node.kubernetes.io/unschedulable` taint."""

        def change(node: Obj) -> None:
            spec = node.setdefault("spec", {})
            taints = [t for t in spec.get("taints") or [] if t.get("key") != UNSCHEDULABLE_TAINT]
            if unschedulable:
                spec["unschedulable"] = True
                taints.append({"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"})
            else:
                spec.pop("unschedulable", None)
            _set_taints(node, taints)

        return self.mutate("nodes", None, name, change)

    def set_node_taints(self, name: str, taints: list[Obj]) -> Obj:
        return self.mutate("nodes", None, name, lambda node: _set_taints(node, list(taints)))

    def set_node_allocatable(
        self, name: str, allocatable: dict[str, str | None], capacity: dict[str, str] | None = None
    ) -> Obj:
        """Change some allocatable amounts (None removes a resource), as the device plugin does
        when a device fails; capacity changes only where given."""

        def change(node: Obj) -> None:
            status = node.setdefault("status", {})
            status["allocatable"] = merge_patch(status.get("allocatable") or {}, allocatable)
            if capacity:
                status["capacity"] = {**(status.get("capacity") or {}), **capacity}

        return self.mutate("nodes", None, name, change)

    def delete_node(self, name: str) -> Obj:
        return self.delete("nodes", None, name)

    # --- pods ---------------------------------------------------------------------------------

    def bind_pod(self, namespace: str, name: str, node: str) -> Obj:
        """What kube-scheduler's binding does: spec.nodeName and PodScheduled=True."""

        def change(pod: Obj) -> None:
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound and bound != node:
                raise ValueError(f"pod {name} is already assigned to node {bound}")
            pod.setdefault("spec", {})["nodeName"] = node
            set_condition(pod.setdefault("status", {}), "PodScheduled", "True")

        return self.mutate("pods", namespace, name, change)

    def pod_running(
        self, namespace: str, name: str, ready: bool = True, node: str | None = None
    ) -> Obj:
        """Containers started (and ready, unless `ready=False`): phase Running, pod and host IP."""
        if node is not None:
            self.bind_pod(namespace, name, node)

        def change(pod: Obj) -> None:
            status = self._started(pod)
            started = status["startTime"]
            status["phase"] = "Running"
            status["containerStatuses"] = [
                _container_status(pod, c, {"running": {"startedAt": started}}, ready)
                for c in _containers(pod)
            ]
            _readiness(status, ready, "ContainersNotReady")

        return self.mutate("pods", namespace, name, change)

    def pod_succeeded(self, namespace: str, name: str) -> Obj:
        """Every container exited 0: phase Succeeded."""
        return self._pod_ended(namespace, name, "Succeeded", None, "Completed", 0, "")

    def pod_failed(
        self,
        namespace: str,
        name: str,
        reason: str = "Error",
        exit_code: int = 1,
        message: str = "",
        container: str | None = None,
    ) -> Obj:
        """One container (the first unless named) terminated with `reason` and `exit_code`, the
        others with 0: phase Failed."""
        return self._pod_ended(namespace, name, "Failed", container, reason, exit_code, message)

    def pod_oom_killed(self, namespace: str, name: str, container: str | None = None) -> Obj:
        return self.pod_failed(namespace, name, "OOMKilled", 137, container=container)

    def pod_waiting(
        self, namespace: str, name: str, reason: str = "ImagePullBackOff", message: str = ""
    ) -> Obj:
        """Containers stuck before starting (ImagePullBackOff, ErrImagePull,
        CreateContainerConfigError, CrashLoopBackOff...): phase stays Pending."""

        def change(pod: Obj) -> None:
            status = pod.setdefault("status", {})
            state: Obj = {"waiting": {"reason": reason}}
            if message:
                state["waiting"]["message"] = message
            status["containerStatuses"] = [
                _container_status(pod, c, state, False) for c in _containers(pod)
            ]
            if pod["spec"].get("nodeName"):
                set_condition(status, "PodScheduled", "True")
            _readiness(status, False, "ContainersNotReady")

        return self.mutate("pods", namespace, name, change)

    def pod_rejected(
        self, namespace: str, name: str, reason: str = "UnexpectedAdmissionError", message: str = ""
    ) -> Obj:
        """The kubelet refuses or evicts the pod: phase Failed with status.reason and message
        (UnexpectedAdmissionError, OutOfnvidia.com/gpu, NodeAffinity, Evicted...)."""

        def change(pod: Obj) -> None:
            status = pod.setdefault("status", {})
            status.update(
                phase="Failed", reason=reason, message=message or f"Pod was rejected: {reason}"
            )
            started = status.get("startTime") or rfc3339()
            if status.get("containerStatuses"):
                status["containerStatuses"] = [
                    _container_status(pod, c, _terminated("Error", 137, started), False)
                    for c in _containers(pod)
                ]
            _readiness(status, False, "PodFailed")

        return self.mutate("pods", namespace, name, change)

    def pod_evicted(
        self, namespace: str, name: str, message: str = "The node was low on resource: memory."
    ) -> Obj:
        return self.pod_rejected(namespace, name, "Evicted", message)

    def pod_unschedulable(
        self, namespace: str, name: str, message: str = "0/1 nodes are available."
    ) -> Obj:
        """What kube-scheduler writes when no node fits: Pending, PodScheduled=False
        reason Unschedulable."""

        def change(pod: Obj) -> None:
            status = pod.setdefault("status", {})
            status["phase"] = "Pending"
            set_condition(status, "PodScheduled", "False", "Unschedulable", message)

        return self.mutate("pods", namespace, name, change)

    def finish_pod_termination(self, namespace: str, name: str, exit_code: int = 143) -> Obj:
        """The kubelet ends a pod marked for deletion: its containers terminate with
        `exit_code`, then it deletes the pod with grace 0 (gone, unless finalizers hold it)."""
        pod = self.get("pods", namespace, name)
        if "deletionTimestamp" not in pod["metadata"]:
            raise ValueError(f"pod {namespace}/{name} is not being deleted")
        phase = "Succeeded" if exit_code == 0 else "Failed"
        reason = "Completed" if exit_code == 0 else "Error"
        if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            pod = self._pod_ended(namespace, name, phase, None, reason, exit_code, "")
        return self._delete(self.resource("pods"), pod, 0)

    def set_status(
        self,
        resource: ResourceRef,
        namespace: str | None,
        name: str,
        status: Obj,
        merge: bool = True,
    ) -> Obj:
        """A controller writes status (merged as a merge patch, or replaced)."""

        def change(obj: Obj) -> None:
            obj["status"] = merge_patch(obj.get("status") or {}, status) if merge else status

        return self.mutate(resource, namespace, name, change)

    def _started(self, pod: Obj) -> Obj:
        if not pod["spec"].get("nodeName"):
            raise ValueError(f"pod {pod['metadata']['name']} is not bound to a node; pass node=")
        status = pod.setdefault("status", {})
        status.setdefault("startTime", rfc3339())
        status.pop("reason", None)
        status.pop("message", None)
        if not status.get("podIP"):
            self._pod_ips += 1
            status["podIP"] = f"10.244.{self._pod_ips // 250}.{self._pod_ips % 250 + 1}"
            status["podIPs"] = [{"ip": status["podIP"]}]
        status["hostIP"] = self._node_ip(pod["spec"]["nodeName"])
        for kind in ("PodScheduled", "Initialized", "PodReadyToStartContainers"):
            set_condition(status, kind, "True")
        return status

    def _pod_ended(
        self,
        namespace: str,
        name: str,
        phase: str,
        failed: str | None,
        reason: str,
        exit_code: int,
        message: str,
    ) -> Obj:
        def change(pod: Obj) -> None:
            status = self._started(pod)
            target = failed or (_containers(pod)[0]["name"] if _containers(pod) else None)
            started = status["startTime"]
            status["phase"] = phase
            status["containerStatuses"] = [
                _container_status(
                    pod,
                    c,
                    _terminated(reason, exit_code, started, message)
                    if c["name"] == target
                    else _terminated("Completed", 0, started),
                    False,
                )
                for c in _containers(pod)
            ]
            _readiness(status, False, "PodCompleted" if phase == "Succeeded" else "PodFailed")

        return self.mutate("pods", namespace, name, change)

    def _node_ip(self, node_name: str) -> str:
        node = self.find("nodes", None, node_name) or {}
        for address in (node.get("status") or {}).get("addresses") or []:
            if address.get("type") == "InternalIP":
                return str(address["address"])
        return ""

    # --- auto kubelet ------------------------------------------------------------------------

    def auto_kubelet(
        self,
        enabled: bool = True,
        run_delay: float = 0.0,
        terminate_delay: float = 0.0,
        termination_exit_code: int = 143,
        check_fit: bool = True,
    ) -> None:
        """Play scheduler and kubelet from now on. A Pending pod without scheduling gates and
        without a node is bound to the first node, by name, that is Ready, schedulable, matches
        its nodeSelector / required node affinity, tolerates its NoSchedule/NoExecute taints
        and (with `check_fit`) has the requested resources left; with no such node it is marked
        Unschedulable (retried when nodes or pods change). A bound pod on a Ready node becomes
        Running after `run_delay` s, unless a test hook has set its container states. A pod
        marked for deletion is ended after `terminate_delay` s, its containers exiting with
        `termination_exit_code`. Must be called on the server's event loop."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        if not enabled:
            self._auto = None
            return
        self._auto = AutoKubelet(run_delay, terminate_delay, termination_exit_code, check_fit)
        self._loop = asyncio.get_running_loop()
        self._usage = {}
        for pod in self.objects("pods"):
            self._account(pod, +1)
        self._sweep_soon()

    def stop_timers(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        self._auto = None

    def _on_change(self, rt: ResourceType, change: Change) -> None:
        if self._auto is None or self._loop is None:
            return
        if rt.key == "pods":
            now = None if change.type == "DELETED" else change.obj
            self._account(change.old, -1)
            self._account(now, +1)
            if now is not None:
                meta = now["metadata"]
                self._loop.call_soon(self._reconcile, meta["namespace"], meta["name"], meta["uid"])
            if _counts_on_node(change.old) and not _counts_on_node(now):
                self._sweep_soon()  # resources freed: a waiting pod may fit now
        elif rt.key == "nodes":
            self._sweep_soon()

    def _account(self, pod: Obj | None, sign: int) -> None:
        node = _counts_on_node(pod)
        if node is None or pod is None:
            return
        usage = self._usage.setdefault(node, Counter())
        for resource, amount in _requests(pod).items():
            usage[resource] += sign * amount  # type: ignore[assignment]

    def _sweep_soon(self) -> None:
        if not self._sweep_pending and self._loop is not None:
            self._sweep_pending = True
            self._loop.call_soon(self._sweep)

    def _sweep(self) -> None:
        self._sweep_pending = False
        for pod in self.objects("pods"):
            meta = pod["metadata"]
            self._reconcile(meta["namespace"], meta["name"], meta["uid"])

    def _reconcile(self, namespace: str, name: str, uid: str) -> None:
        pod = self.find("pods", namespace, name)
        if self._auto is None or pod is None or pod["metadata"]["uid"] != uid:
            return
        spec, status = pod["spec"], pod.get("status") or {}
        if "deletionTimestamp" in pod["metadata"]:
            if spec.get("nodeName") and pod["metadata"].get("deletionGracePeriodSeconds", 0) > 0:
                self._after(self._auto.terminate_delay, ("end", uid), self._auto_end, pod)
            return
        if status.get("phase") != "Pending" or spec.get("schedulingGates"):
            return
        if not spec.get("nodeName"):
            self._schedule(pod)
            return
        # A test hook that set container states (ImagePullBackOff, say) keeps the pod.
        node = self.find("nodes", None, spec["nodeName"])
        if node_ready(node) and not status.get("containerStatuses"):
            self._after(self._auto.run_delay, ("run", uid), self._auto_run, pod)

    def _after(
        self, delay: float, key: tuple[str, str], action: Callable[[Obj], Any], pod: Obj
    ) -> None:
        if key in self._timers or self._loop is None:
            return
        self._timers[key] = self._loop.call_later(delay, self._fire, key, action, pod)

    def _fire(self, key: tuple[str, str], action: Callable[[Obj], Any], pod: Obj) -> None:
        self._timers.pop(key, None)
        if self._auto is None:
            return
        meta = pod["metadata"]
        current = self.find("pods", meta["namespace"], meta["name"])
        if current is None or current["metadata"]["uid"] != meta["uid"]:
            return
        # The pod may have moved on meanwhile (a test hook or a client changed it).
        with contextlib.suppress(ApiError, ValueError):
            action(current)

    def _auto_run(self, pod: Obj) -> None:
        meta, status = pod["metadata"], pod.get("status") or {}
        pending = status.get("phase") == "Pending" and not status.get("containerStatuses")
        if pending and "deletionTimestamp" not in meta:
            self.pod_running(meta["namespace"], meta["name"])

    def _auto_end(self, pod: Obj) -> None:
        meta = pod["metadata"]
        if "deletionTimestamp" in meta and self._auto is not None:
            exit_code = self._auto.termination_exit_code
            self.finish_pod_termination(meta["namespace"], meta["name"], exit_code)

    def _schedule(self, pod: Obj) -> None:
        nodes = self.objects("nodes")
        reasons: Counter[str] = Counter()
        for node in nodes:
            why = self._unfit(pod, node)
            if why is None:
                self.bind_pod(
                    pod["metadata"]["namespace"], pod["metadata"]["name"], node["metadata"]["name"]
                )
                return
            reasons[why] += 1
        summary = ", ".join(f"{count} {why}" for why, count in sorted(reasons.items()))
        message = f"0/{len(nodes)} nodes are available: {summary or 'no nodes'}."
        self.pod_unschedulable(pod["metadata"]["namespace"], pod["metadata"]["name"], message)

    def _unfit(self, pod: Obj, node: Obj) -> str | None:
        """Why `node` cannot take `pod` (the first reason, in kube-scheduler's words), or None."""
        spec = pod["spec"]
        if not node_ready(node):
            return "node(s) were not ready"
        if (node.get("spec") or {}).get("unschedulable"):
            return "node(s) were unschedulable"
        if not _selector_matches(spec, node):
            return "node(s) didn't match Pod's node affinity/selector"
        for taint in (node.get("spec") or {}).get("taints") or []:
            blocking = taint.get("effect") in ("NoSchedule", "NoExecute")
            if blocking and not _tolerated(taint, spec.get("tolerations") or []):
                return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value', '')}}}"  # noqa: E501
        if self._auto is not None and self._auto.check_fit:
            return self._insufficient(pod, node)
        return None

    def _insufficient(self, pod: Obj, node: Obj) -> str | None:
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        used = self._usage.get(node["metadata"]["name"], Counter())
        for resource, amount in sorted(_requests(pod).items()):
            if amount <= 0:
                continue
            available = parse_quantity(str(allocatable.get(resource, "0")))
            if used[resource] + amount > available:
                return f"Insufficient {resource}"
        return None


def _readiness(status: Obj, ready: bool, reason: str) -> None:
    if ready:
        set_condition(status, "ContainersReady", "True")
        set_condition(status, "Ready", "True")
    else:
        set_condition(status, "ContainersReady", "False", reason)
        set_condition(status, "Ready", "False", reason)


def _set_taints(node: Obj, taints: list[Obj]) -> None:
    spec = node.setdefault("spec", {})
    if taints:
        spec["taints"] = taints
    else:
        spec.pop("taints", None)
