"""The kubernetes backend's pure parts: names and label values, the pods and Service a
placement becomes, what a gang's pods say about its run, and Node objects as inventory."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from core.model import AcceleratorModel, PriceTier
from schemas.events import PlacementDecided, ReplicaAssignment
from schemas.job import JobSpec
from services.executor.kube import names
from services.executor.kube.names import GangNames, label_value
from services.executor.kube.nodes import NodeLabels, lost_devices, node_view, quantity
from services.executor.kube.pods import (
    PodOptions,
    build_disruption_budget,
    build_pod,
    build_service,
)
from services.executor.kube.status import GangPhase, gang_state, pod_failure

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LABEL_VALUE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def placement(
    job_id: str = "job-1",
    replicas: int = 1,
    gpus: float = 1,
    accelerator: str = "H100",
    **spec: Any,
) -> PlacementDecided:
    fields = {"tenant": "vision", "job_id": job_id, "image": "trainer:1", "replicas": replicas}
    return PlacementDecided(
        job_id=job_id,
        attempt=2,
        epoch=7,
        leader="l",
        cluster="onprem-h100",
        accelerator_type=accelerator,
        spec=JobSpec.model_validate({**fields, **spec}),
        replicas=[
            ReplicaAssignment(replica=i, node_id=f"n{i}", accelerators=gpus, cpu=3.5, memory_gb=8)
            for i in range(replicas)
        ],
    )


def pod(phase: str = "Pending", replica: int = 0, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": f"p{replica}", "labels": {names.REPLICA: str(replica)}},
        "spec": {"nodeName": f"n{replica}"},
        "status": {"phase": phase, **status},
    }


def terminated(reason: str, code: int) -> dict[str, Any]:
    return {
        "containerStatuses": [
            {"name": "main", "state": {"terminated": {"reason": reason, "exitCode": code}}}
        ]
    }


def waiting(reason: str) -> dict[str, Any]:
    return {"containerStatuses": [{"name": "main", "state": {"waiting": {"reason": reason}}}]}


# --- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        "vision",
        "a" * 63,
        "a" * 64,
        "team/with:colons",
        "-leading",
        "trailing.",
        "über",
        "",
        "x" * 300,
    ],
)
def test_label_values_are_always_valid(raw: str) -> None:
    value = label_value(raw)
    assert len(value) <= 63 and set(value) <= LABEL_VALUE_CHARS
    assert value == "" or (value[0].isalnum() and value[-1].isalnum())
    if raw in ("vision", "a" * 63, ""):
        assert value == raw  # valid already: kept as it is
    else:
        assert value != raw and value.endswith(names.digest(raw))


def test_long_values_keep_apart_by_their_hash() -> None:
    assert label_value("t" * 70 + "a") != label_value("t" * 70 + "b")


@pytest.mark.parametrize("job_id", ["job-1", "Job_ID.with:Odd", "9" * 64, "j"])
def test_gang_names_are_dns_labels_and_deterministic(job_id: str) -> None:
    gang = GangNames(job_id, 12)
    assert gang == GangNames(job_id, 12)
    assert len(gang.service) <= 63 and gang.service[0].isalpha()
    assert set(gang.service) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert gang.pod(0) != gang.pod(1) and len(gang.pod(4095)) <= 63
    assert GangNames(job_id, 13).service != gang.service


# --- pods -------------------------------------------------------------------------------------


def test_a_replica_is_a_gated_pinned_pod_with_its_resources_and_peers() -> None:
    p = placement(replicas=2, gpus=4, max_runtime_s=100, command=("python", "train.py"))
    built = build_pod(p, p.replicas[1], "host-n1", PodOptions(namespace="jobs"))
    meta, spec = built["metadata"], built["spec"]
    assert meta["name"] == GangNames("job-1", 2).pod(1) and meta["namespace"] == "jobs"
    assert meta["labels"][names.JOB] == "job-1" and meta["labels"][names.EPOCH] == "7"
    assert meta["labels"][names.ATTEMPT] == "2" and meta["labels"][names.REPLICA] == "1"
    assert meta["annotations"][names.TENANT] == "vision"
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": "host-n1"}
    assert spec["schedulingGates"] == [{"name": names.GATE}]
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 100
    assert spec["terminationGracePeriodSeconds"] == 30
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    (container,) = spec["containers"]
    assert container["image"] == "trainer:1" and container["command"] == ["python", "train.py"]
    assert container["resources"] == {
        "requests": {"cpu": "3500m", "memory": "8192Mi", "nvidia.com/gpu": "4"},
        "limits": {"memory": "8192Mi", "nvidia.com/gpu": "4"},
    }
    env = {e["name"]: e["value"] for e in container["env"]}
    service = GangNames("job-1", 2).service
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == f"r0.{service}.jobs.svc"
    assert env["QM_PEERS"] == f"r0.{service}.jobs.svc,r1.{service}.jobs.svc"
    assert spec["hostname"] == "r1" and spec["subdomain"] == service


@pytest.mark.parametrize(
    ("accelerator", "gpus", "resource", "amount"),
    [
        ("H100", 8, "nvidia.com/gpu", "8"),
        ("TPU-v5e", 4, "google.com/tpu", "4"),
        ("H100", 0.5, "nvidia.com/gpu.shared", "2"),
        ("H100", 0.1, "nvidia.com/gpu.shared", "1"),
    ],
)
def test_accelerators_become_extended_resources(
    accelerator: str, gpus: float, resource: str, amount: str
) -> None:
    p = placement(gpus=gpus, accelerator=accelerator)
    resources = build_pod(p, p.replicas[0], "h", PodOptions())["spec"]["containers"][0]["resources"]
    assert resources["limits"][resource] == amount == resources["requests"][resource]


def test_the_gang_service_is_headless_and_selects_the_attempt() -> None:
    p = placement(replicas=3)
    service = build_service(p, PodOptions(namespace="jobs"))
    assert service["metadata"]["name"] == GangNames("job-1", 2).service
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"][names.ATTEMPT] == "2"
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_a_tpu_slice_pod_selects_its_nodes_slice_labels_and_its_priority_class() -> None:
    p = placement(gpus=4, accelerator="TPU-v5e", priority_class="critical")
    slice_labels = {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x4",
    }
    options = PodOptions(priority_classes={"critical": "qm-critical"})
    built = build_pod(p, p.replicas[0], "host-n0", options, slice_labels)
    assert built["spec"]["nodeSelector"] == {**slice_labels, "kubernetes.io/hostname": "host-n0"}
    assert built["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    assert built["spec"]["priorityClassName"] == "qm-critical"
    # A class the cluster has no PriorityClass for leaves the pod's priority to the cluster.
    plain = build_pod(placement(), placement().replicas[0], "host-n0", options)
    assert "priorityClassName" not in plain["spec"]
    # A pinned label cannot move the pod off its node.
    moved = build_pod(p, p.replicas[0], "host-n0", options, {"kubernetes.io/hostname": "x"})
    assert moved["spec"]["nodeSelector"]["kubernetes.io/hostname"] == "host-n0"


def test_the_gang_disruption_budget_keeps_every_member() -> None:
    p = placement(replicas=3)
    budget = build_disruption_budget(p, PodOptions(namespace="jobs"))
    service = build_service(p, PodOptions(namespace="jobs"))
    assert budget["metadata"]["name"] == service["metadata"]["name"]
    assert budget["spec"]["minAvailable"] == 3
    assert budget["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]


def test_a_node_view_keeps_the_pinned_labels_it_has() -> None:
    labels = NodeLabels(pinned=("cloud.google.com/gke-tpu-topology", "absent/label"))
    view = node_view(node(labels={"cloud.google.com/gke-tpu-topology": "2x4"}), "c", labels, TYPES)
    assert view.pinned == {"cloud.google.com/gke-tpu-topology": "2x4"}


# --- status -----------------------------------------------------------------------------------


def judge(pods: list[dict[str, Any]], replicas: int = 2, after_s: float = 60) -> Any:
    return gang_state(pods, replicas, now=T0, unschedulable_after_s=after_s, complete=True)


@pytest.mark.parametrize(
    ("status", "reason_code", "exit_code"),
    [
        (terminated("OOMKilled", 137), "out_of_memory", 137),
        (terminated("Error", 2), "application_error", 2),
        ({"reason": "Evicted", "message": "low on memory"}, "evicted", None),
        ({"reason": "UnexpectedAdmissionError"}, "admission_error", None),
        ({"reason": "DeadlineExceeded"}, "max_runtime_exceeded", None),
    ],
)
def test_failures_are_classified(
    status: dict[str, Any], reason_code: str, exit_code: int | None
) -> None:
    failure = pod_failure(pod("Failed", **status))
    assert failure is not None
    assert (failure.reason_code, failure.exit_code) == (reason_code, exit_code)


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff", "InvalidImageName"])
def test_an_image_that_will_not_pull_fails_the_pod(reason: str) -> None:
    failure = pod_failure(pod("Pending", **waiting(reason)))
    assert failure is not None and failure.reason_code == "image_pull_error"


def test_a_gang_runs_when_every_replica_runs_and_succeeds_when_all_did() -> None:
    assert judge([pod("Running", 0), pod("Pending", 1)]).phase is GangPhase.PENDING
    assert judge([pod("Running", 0)]).phase is GangPhase.LOST  # complete, one gone
    state = judge([pod("Running", 0), pod("Running", 1)])
    assert state.phase is GangPhase.RUNNING and state.nodes == ("n0", "n1")
    assert judge([pod("Succeeded", 0), pod("Running", 1)]).phase is GangPhase.RUNNING
    assert judge([pod("Succeeded", 0), pod("Succeeded", 1)]).phase is GangPhase.SUCCEEDED
    failed = judge([pod("Running", 0), pod("Failed", 1, **terminated("OOMKilled", 137))])
    assert failed.phase is GangPhase.FAILED and failed.failure.reason_code == "out_of_memory"


def test_a_gang_still_being_created_is_pending() -> None:
    state = gang_state([pod("Pending", 0)], 2, now=T0, unschedulable_after_s=0, complete=False)
    assert state.phase is GangPhase.PENDING


def test_an_unschedulable_pod_is_refused_after_the_setting() -> None:
    condition = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/3 nodes are available",
        "lastTransitionTime": (T0 - timedelta(seconds=30)).isoformat(),
    }
    stuck = [pod("Pending", 0, conditions=[condition]), pod("Pending", 1)]
    assert judge(stuck, after_s=60).phase is GangPhase.PENDING
    refused = judge(stuck, after_s=30)
    assert refused.phase is GangPhase.REFUSED
    assert "0/3 nodes are available" in refused.failure.message


def test_pods_on_their_way_out_are_not_lost() -> None:
    leaving = pod("Running", 1)
    leaving["metadata"]["deletionTimestamp"] = T0.isoformat()
    assert judge([pod("Running", 0), leaving]).phase is GangPhase.PENDING


# --- nodes ------------------------------------------------------------------------------------


def node(name: str = "n0", gpus: str = "8", **extra: Any) -> dict[str, Any]:
    labels = {
        "kubernetes.io/hostname": f"host-{name}",
        "quartermaster.io/accelerator": "H100",
        "quartermaster.io/nvlink-domain": "nvl-1",
        "topology.kubernetes.io/rack": "r1",
        "topology.kubernetes.io/zone": "b1",
        "quartermaster.io/price-tier": "spot",
    }
    return {
        "metadata": {"name": name, "labels": {**labels, **extra.pop("labels", {})}},
        "spec": extra.pop("spec", {}),
        "status": {
            "allocatable": {"nvidia.com/gpu": gpus, "cpu": "7500m", "memory": "64Gi"},
            "conditions": [{"type": "Ready", "status": extra.pop("ready", "True")}],
        },
    }


TYPES = {"H100": AcceleratorModel("H100", "hopper", 80, 3.0)}


def test_a_node_object_is_an_inventory_node() -> None:
    view = node_view(node(), "c", NodeLabels(), TYPES)
    assert view.hostname == "host-n0" and view.ready and not view.cordoned
    n = view.node
    assert n is not None
    assert (n.accelerators, n.cpu, n.memory_gb) == (8, 7.5, 64)
    assert (n.nvlink_domain, n.rack, n.block) == ("nvl-1", "r1", "b1")
    assert n.price_tier is PriceTier.SPOT and n.accelerator.generation == "hopper"
    assert n.healthy


def test_not_ready_cordoned_or_quarantined_nodes_are_not_healthy() -> None:
    labels = NodeLabels(quarantine_taint="qm/quarantined")
    assert not node_view(node(ready="False"), "c", labels, TYPES).node.healthy  # type: ignore[union-attr]
    cordoned = node_view(node(spec={"unschedulable": True}), "c", labels, TYPES)
    assert cordoned.cordoned and not cordoned.node.healthy  # type: ignore[union-attr]
    tainted = node(spec={"taints": [{"key": "qm/quarantined", "effect": "NoSchedule"}]})
    assert node_view(tainted, "c", labels, TYPES).quarantined


def test_a_node_without_the_accelerator_label_is_not_inventory() -> None:
    bare = node()
    del bare["metadata"]["labels"]["quartermaster.io/accelerator"]
    assert node_view(bare, "c", NodeLabels(), TYPES).node is None


def test_a_node_reporting_more_devices_than_a_node_has_is_not_inventory() -> None:
    """A device plugin reporting 10**6 GPUs: the node is left out, where its count would
    have made the whole cluster's inventory unsendable (the wire takes 0 to 4,096)."""
    assert node_view(node(gpus="4096"), "c", NodeLabels(), TYPES).node is not None
    assert node_view(node(gpus="1000000"), "c", NodeLabels(), TYPES).node is None


def test_lost_devices_are_counted() -> None:
    before = node_view(node(gpus="8"), "c", NodeLabels(), TYPES)
    assert lost_devices(before, node_view(node(gpus="6"), "c", NodeLabels(), TYPES)) == 2
    assert lost_devices(before, node_view(node(gpus="8"), "c", NodeLabels(), TYPES)) == 0
    assert lost_devices(None, before) == 0


@pytest.mark.parametrize(
    ("text", "value"),
    [("8", 8), ("7500m", 7.5), ("64Gi", 64 * 2**30), ("1k", 1000), ("junk", 0), (None, 0)],
)
def test_quantities(text: str | None, value: float) -> None:
    assert float(quantity(text)) == value
