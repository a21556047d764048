"""Stops and nodes on the kubernetes backend, against the Kubernetes API double: preemption and
cancel delete the gang with the granted grace, a checkpoint request is an annotation the
workload sees, a pod nobody can schedule goes back to the scheduler, and Node objects become
inventory and health inputs."""

from __future__ import annotations

from schemas.health import SignalKind
from services.executor.backend import Launch
from services.executor.kube import names
from services.executor.kube.names import GangNames
from tests.integration.kube_rig import (
    NAMESPACE,
    Rig,
    add_gpu_node,
    create_namespace,
    placement,
    rig,
)
from tests.kubeapi import KubeApiDouble, RunningDouble
from tests.kubeapi.fixtures import kube_api  # noqa: F401


async def running_gang(r: Rig, double: KubeApiDouble, job_id: str, nodes: list[str]) -> list[str]:
    await r.place(placement(job_id, nodes, gpus=8, checkpoint_grace_s=45))
    pods = await r.wait(
        lambda: (
            r.pod_names(job_id, len(nodes))
            if len(r.pods(job_id)) == len(nodes)
            and not any(p["spec"].get("schedulingGates") for p in r.pods(job_id))
            else None
        ),
        "the gang ungated",
    )
    for name, node in zip(pods, nodes, strict=True):
        double.pod_running(NAMESPACE, name, node=node)
    await r.wait_event("JobStarted", job_id)
    return pods  # type: ignore[no-any-return]


def deleted(double: KubeApiDouble, pods: list[str]) -> dict[str, int | None]:
    return {d.name: d.requested_grace_seconds for d in double.deletions if d.name in pods}


async def test_preemption_deletes_the_gang_with_the_granted_grace(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    add_gpu_node(double, "gpu-1")
    async with rig(kube_api) as r:
        pods = await running_gang(r, double, "victim", ["gpu-0", "gpu-1"])
        await r.checkpoint("victim")
        await r.wait(
            lambda: all(
                names.CHECKPOINT in double.get("pods", NAMESPACE, p)["metadata"]["annotations"]
                for p in pods
            ),
            "the checkpoint annotation on every pod",
        )
        await r.preempt("victim")
        preempted = await r.wait_event("JobPreempted", "victim")
        assert preempted.payload["reason_code"] == "priority"
        await r.wait(lambda: len(deleted(double, pods)) == 2, "both pods deleted")
        assert deleted(double, pods) == {p: 45 for p in pods}
        # Terminating pods hold on for their grace; the gang is over for the executor.
        assert all(
            double.get("pods", NAMESPACE, p)["metadata"].get("deletionTimestamp") for p in pods
        )
        for p in pods:
            double.finish_pod_termination(NAMESPACE, p)
        await r.wait(lambda: ("victim", 1) not in r.backend.gangs, "the gang forgotten")
        assert r.events("RunFailed") == [] and r.events("JobFinished") == []
        assert r.book.by_job == {}


async def test_cancel_deletes_the_gang_and_says_canceled(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    async with rig(kube_api) as r:
        pods = await running_gang(r, double, "gone", ["gpu-0"])
        await r.cancel("gone")
        finished = await r.wait_event("JobFinished", "gone")
        assert finished.payload["outcome"] == "canceled"
        await r.wait(lambda: deleted(double, pods) == {pods[0]: 45}, "the pod deleted")
        service = GangNames("gone", 1).service
        await r.wait(lambda: double.find("services", NAMESPACE, service) is None, "no Service")


async def test_a_redelivered_launch_creates_nothing_twice(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    add_gpu_node(double, "gpu-1")
    async with rig(kube_api) as r:
        p = placement("twice", ["gpu-0", "gpu-1"], gpus=8)
        await r.place(p)
        await r.backend.act([Launch(p)])  # as if the launch came again after a crash
        await r.wait(lambda: r.backend.actions.empty() and len(r.pods("twice")) == 2, "pods")
        await r.backend.actions.join()
        creates = [q for q in double.requests if q.verb == "create" and q.resource == "pods"]
        assert len(creates) == 4 and len(r.pods("twice")) == 2  # the second try got 409s
        assert r.events("PlacementRefused") == []


async def test_an_unschedulable_pod_is_refused_back_to_the_scheduler(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    async with rig(kube_api, unschedulable_after_s=0) as r:
        await r.place(placement("stuck", ["gpu-0"], gpus=8))
        (pod,) = await r.wait(
            lambda: [p for p in r.pods("stuck") if not p["spec"].get("schedulingGates")],
            "the pod ungated",
        )
        double.pod_unschedulable(NAMESPACE, pod["metadata"]["name"], "0/1 nodes are available")
        refused = await r.wait_event("PlacementRefused", "stuck")
        assert refused.payload["reason_code"] == "unschedulable"
        assert "0/1 nodes are available" in refused.payload["message"]
        assert refused.payload["epoch"] == 1
        await r.wait(lambda: not r.pods("stuck"), "the pod deleted")
        assert r.book.by_job == {} and "stuck" not in r.executor.running


async def test_an_invalid_pod_fails_the_job_with_the_apis_reason(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    """Not a refusal: placed again, the same spec would be refused again (a loop)."""
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    async with rig(kube_api) as r:
        await r.place(placement("noimage", ["gpu-0"], image=None))
        finished = await r.wait_event("JobFinished", "noimage")
        assert finished.payload["outcome"] == "failed"
        assert finished.payload["reason_code"] == "invalid_pod"
        assert "image" in finished.payload["message"], finished.payload
        assert not r.events("PlacementRefused")
        assert r.book.by_job == {}


async def test_a_forbidden_pod_is_refused_back_not_failed(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    """A 403 (a full ResourceQuota, an admission rule, a PriorityClass the cluster lacks) is
    the cluster's doing: the placement goes back to the scheduler and the job is not failed."""
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    double.inject_fault(
        "create", "pods", status=403, message="exceeded quota: compute-resources", times=None
    )
    async with rig(kube_api) as r:
        await r.place(placement("quota", ["gpu-0"]))
        refused = await r.wait_event("PlacementRefused", "quota")
        assert refused.payload["reason_code"] == "cluster_forbidden"
        assert "exceeded quota" in refused.payload["message"]
        assert not r.events("JobFinished") and not r.events("RunFailed")
        assert r.book.by_job == {}


async def test_nodes_become_inventory_and_health_inputs(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    add_gpu_node(double, "gpu-1")
    double.add_node("cpu-0")  # no accelerator label: not a node Quartermaster places on
    async with rig(kube_api) as r:
        nodes = r.inventory.nodes()
        assert sorted(nodes) == ["gpu-0", "gpu-1"]
        assert nodes["gpu-0"].accelerators == 8 and nodes["gpu-0"].accelerator.type == "H100"
        assert nodes["gpu-0"].memory_gb == 512 and nodes["gpu-0"].cpu == 64
        assert r.inventory.hostname("gpu-0") == "host-gpu-0"
        assert r.inventory.silent() == set()

        double.cordon_node("gpu-1")
        await r.wait(lambda: r.inventory.views["gpu-1"].cordoned, "the cordon seen")
        assert r.inventory.nodes()["gpu-1"].healthy is False
        await r.place(placement("late", ["gpu-1"]))
        refused = await r.wait_event("PlacementRefused", "late")
        assert "unhealthy" in refused.payload["message"]

        double.set_node_ready("gpu-0", False)
        await r.wait(lambda: not r.inventory.views["gpu-0"].ready, "NotReady seen")
        assert r.inventory.silent() == {"gpu-0"}  # its heartbeats stop: health hears silence

        double.set_node_allocatable("gpu-1", {"nvidia.com/gpu": "7"})
        await r.wait(lambda: r.probes, "a probe")
        (probe,) = r.probes
        assert probe.node_id == "gpu-1" and probe.kind is SignalKind.PCIE_ERROR
        assert "from 8 to 7" in probe.detail
        assert len(r.book.use["gpu-1"].devices) == 7


async def test_a_quarantined_node_hands_back_its_gangs_and_is_cordoned_until_it_recovers(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    async with rig(kube_api) as r:
        pods = await running_gang(r, double, "hit", ["gpu-0"])
        await r.node_unhealthy("gpu-0")
        lost = await r.wait_event("JobPreempted", "hit")
        assert lost.payload["reason_code"] == "node_failure"
        await r.wait(lambda: deleted(double, pods) == {pods[0]: 0}, "the pod deleted at once")
        node = await r.wait(
            lambda: (n := double.get("nodes", None, "gpu-0"))["spec"].get("unschedulable") and n,
            "the node cordoned",
        )
        ours = {"key": "quartermaster.io/quarantined", "value": "xid_79", "effect": "NoSchedule"}
        assert ours in node["spec"]["taints"]
        await r.wait(lambda: r.inventory.views["gpu-0"].quarantined, "the quarantine seen")
        assert r.inventory.nodes()["gpu-0"].healthy is False

        await r.node_recovered("gpu-0")
        node = await r.wait(
            lambda: (
                not (n := double.get("nodes", None, "gpu-0"))["spec"].get("unschedulable") and n
            ),
            "the node uncordoned",
        )
        assert node["spec"]["taints"] == [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]
        await r.wait(lambda: r.inventory.nodes()["gpu-0"].healthy, "the node healthy again")
