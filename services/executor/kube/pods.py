"""A placement as Kubernetes objects, built as plain data (pure): one pod per replica pinned to
the node the scheduler chose, held by a scheduling gate until the whole gang exists, and one
headless Service through which the replicas find each other."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.events import PlacementDecided, ReplicaAssignment
from services.executor.kube import names
from services.executor.kube.names import GangNames, label_value

Obj = dict[str, Any]
HOSTNAME_LABEL = "kubernetes.io/hostname"
ANNOTATIONS_DIR = "/etc/quartermaster"


@dataclass(frozen=True)
class PodOptions:
    """How this cluster wants its pods (from the executor's settings)."""

    namespace: str = "quartermaster-jobs"
    cluster: str = "onprem-h100"
    # Extended resource per accelerator type prefix; anything else is an NVIDIA GPU.
    accelerator_resources: Mapping[str, str] = field(
        default_factory=lambda: {"TPU": "google.com/tpu"}
    )
    default_resource: str = "nvidia.com/gpu"
    # A fraction of a device is asked as shares of the cluster's sharing resource (time-slicing
    # or MPS: `shares` per device), at least one.
    fraction_resource: str = "nvidia.com/gpu.shared"
    fraction_shares: int = 4
    # Taints of accelerator nodes the pods tolerate (NoSchedule, any value).
    toleration_keys: tuple[str, ...] = ("nvidia.com/gpu", "google.com/tpu")
    default_image: str | None = None
    master_port: int = 29500
    container: str = "main"
    # The job's priority class -> the cluster's PriorityClass for its pods (none: unset), so
    # the cluster's own scheduler orders and preempts them as Quartermaster does.
    priority_classes: Mapping[str, str] = field(default_factory=dict)
    # A PodDisruptionBudget per gang (minAvailable = every replica): a voluntary eviction (a
    # node drain) waits instead of breaking a gang one member at a time.
    gang_disruption_budget: bool = True


def accelerator_resource(accelerator_type: str, options: PodOptions) -> str:
    for prefix, resource in options.accelerator_resources.items():
        if accelerator_type.upper().startswith(prefix.upper()):
            return resource
    return options.default_resource


def _resources(p: PlacementDecided, r: ReplicaAssignment, options: PodOptions) -> Obj:
    memory = f"{max(math.ceil(r.memory_gb * 1024), 1)}Mi"
    requests: Obj = {"cpu": f"{max(math.ceil(r.cpu * 1000), 1)}m", "memory": memory}
    limits: Obj = {"memory": memory}  # the limit is the ask: over it the replica is OOMKilled
    if r.accelerators >= 1:
        limits[accelerator_resource(p.accelerator_type, options)] = str(round(r.accelerators))
    elif r.accelerators > 0:
        shares = max(math.ceil(r.accelerators * options.fraction_shares - 1e-9), 1)
        limits[options.fraction_resource] = str(shares)
    # Extended resources must be asked equally in requests and limits.
    for name, amount in limits.items():
        if name != "memory":
            requests[name] = amount
    return {"requests": requests, "limits": limits}


def labels(p: PlacementDecided) -> dict[str, str]:
    spec = p.spec
    return {
        names.MANAGED_BY: names.MANAGER,
        names.CLUSTER: label_value(p.cluster),
        names.JOB: label_value(p.job_id),
        names.ATTEMPT: str(p.attempt),
        names.EPOCH: str(p.epoch),
        names.TENANT: label_value(spec.tenant),
        names.PROJECT: label_value(spec.project),
        names.QUEUE: label_value(spec.queue),
    }


def raw_values(p: PlacementDecided) -> dict[str, str]:
    """The raw values behind the (possibly hashed) labels, and the granted grace."""
    spec = p.spec
    return {
        names.CLUSTER: p.cluster,
        names.JOB: p.job_id,
        names.TENANT: spec.tenant,
        names.PROJECT: spec.project,
        names.QUEUE: spec.queue,
        names.REPLICAS: str(len(p.replicas)),
        names.GRACE: str(grace_s(p)),
    }


def grace_s(p: PlacementDecided) -> int:
    return math.ceil(p.spec.checkpoint_grace_s)


def _env(
    p: PlacementDecided, r: ReplicaAssignment, gang: GangNames, options: PodOptions
) -> list[Obj]:
    values = {
        "QM_JOB_ID": p.job_id,
        "QM_ATTEMPT": str(p.attempt),
        "RANK": str(r.replica),
        "WORLD_SIZE": str(len(p.replicas)),
        "MASTER_ADDR": gang.address(0, options.namespace),
        "MASTER_PORT": str(options.master_port),
        "QM_PEERS": ",".join(
            gang.address(x.replica, options.namespace)
            for x in sorted(p.replicas, key=lambda x: x.replica)
        ),
        "QM_ANNOTATIONS_FILE": f"{ANNOTATIONS_DIR}/annotations",
    }
    return [{"name": k, "value": v} for k, v in values.items()]


def build_pod(
    p: PlacementDecided,
    r: ReplicaAssignment,
    hostname: str,
    options: PodOptions,
    pinned: Mapping[str, str] | None = None,
) -> Obj:
    """The pod of replica `r`, pinned to the node whose `kubernetes.io/hostname` label is
    `hostname` (kube-scheduler still checks fit and taints), behind the gang's gate. `pinned`:
    more of that node's labels to select on (a TPU slice's accelerator and topology labels,
    which the cluster's admission expects on TPU pods)."""
    gang = GangNames(p.job_id, p.attempt)
    container: Obj = {
        "name": options.container,
        "image": p.spec.image or options.default_image or "",
        "env": _env(p, r, gang, options),
        "resources": _resources(p, r, options),
        "ports": [{"name": "master", "containerPort": options.master_port}],
        # The workload sees a checkpoint request appear in this file (downward API).
        "volumeMounts": [{"name": "quartermaster", "mountPath": ANNOTATIONS_DIR}],
    }
    if p.spec.command:
        container["command"] = list(p.spec.command)
    spec: Obj = {
        "restartPolicy": "Never",
        "hostname": gang.hostname(r.replica),
        "subdomain": gang.service,
        "nodeSelector": {**(pinned or {}), HOSTNAME_LABEL: hostname},
        "schedulingGates": [{"name": names.GATE}],
        "terminationGracePeriodSeconds": grace_s(p),
        "tolerations": [
            {"key": key, "operator": "Exists", "effect": "NoSchedule"}
            for key in options.toleration_keys
        ],
        "containers": [container],
        "volumes": [
            {
                "name": "quartermaster",
                "downwardAPI": {
                    "items": [
                        {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}
                    ]
                },
            }
        ],
    }
    if p.spec.max_runtime_s is not None:
        spec["activeDeadlineSeconds"] = math.ceil(p.spec.max_runtime_s)
    priority_class = options.priority_classes.get(p.spec.priority_class or "")
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": gang.pod(r.replica),
            "namespace": options.namespace,
            "labels": {**labels(p), names.REPLICA: str(r.replica)},
            "annotations": raw_values(p),
        },
        "spec": spec,
    }


def _gang_selector(p: PlacementDecided) -> dict[str, str]:
    own = labels(p)
    return {k: own[k] for k in (names.MANAGED_BY, names.CLUSTER, names.JOB, names.ATTEMPT)}


def build_disruption_budget(p: PlacementDecided, options: PodOptions) -> Obj:
    """The gang's PodDisruptionBudget: no voluntary eviction while every member is needed.
    Quartermaster's own stops delete pods (not evictions) and are not held by it."""
    gang = GangNames(p.job_id, p.attempt)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": gang.service,
            "namespace": options.namespace,
            "labels": labels(p),
            "annotations": raw_values(p),
        },
        "spec": {"minAvailable": len(p.replicas), "selector": {"matchLabels": _gang_selector(p)}},
    }


def build_service(p: PlacementDecided, options: PodOptions) -> Obj:
    """The gang's headless Service: stable DNS names for the replicas, ready or not."""
    gang = GangNames(p.job_id, p.attempt)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": gang.service,
            "namespace": options.namespace,
            "labels": labels(p),
            "annotations": raw_values(p),
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _gang_selector(p),
            "ports": [{"name": "master", "port": options.master_port}],
        },
    }
