"""The executor's kubernetes backend driving the Kubernetes API double over HTTP with the real
kubernetes-asyncio client: placements become gated pods that start together, what the pods do
becomes job.started / job.finished / job.run.failed / placement.refused, stops delete with the
granted grace, and the watch survives 410 Gone and cut streams."""

from __future__ import annotations

import pytest

from schemas import topics
from services.executor.kube import names
from tests.integration.kube_rig import (
    NAMESPACE,
    add_gpu_node,
    create_namespace,
    placement,
    rig,
)
from tests.kubeapi import RunningDouble
from tests.kubeapi.fixtures import kube_api  # noqa: F401


async def test_a_single_job_runs_and_succeeds(kube_api: RunningDouble) -> None:  # noqa: F811
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    async with rig(kube_api) as r:
        await r.place(placement("job-1", ["gpu-0"], gpus=2))
        assert r.events("JobStarted") == []  # not before its pod runs
        (pod,) = await r.wait(lambda: r.pods("job-1"), "the pod")
        name = pod["metadata"]["name"]
        await r.wait(
            lambda: not double.get("pods", NAMESPACE, name)["spec"].get("schedulingGates"),
            "the gate off",
        )
        pod = double.get("pods", NAMESPACE, name)
        assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "host-gpu-0"}
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert pod["metadata"]["labels"][names.JOB] == "job-1"
        double.pod_running(NAMESPACE, name, node="gpu-0")
        started = await r.wait_event("JobStarted", "job-1")
        assert started.payload["nodes"] == ["gpu-0"]
        double.pod_succeeded(NAMESPACE, name)
        finished = await r.wait_event("JobFinished", "job-1")
        assert finished.payload["outcome"] == "succeeded"
        assert "job-1" not in r.executor.running
        await r.wait(lambda: not r.pods("job-1"), "the finished pod removed")
        assert [m.topic for m in r.relay.sent] == [topics.JOB_STARTED, topics.JOB_FINISHED]


async def test_a_gang_is_created_whole_before_any_gate_is_lifted(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    for n in ("gpu-0", "gpu-1", "gpu-2"):
        add_gpu_node(double, n)
    async with rig(kube_api) as r:
        await r.place(placement("gang", ["gpu-0", "gpu-1", "gpu-2"], gpus=8))
        names_ = r.pod_names("gang", 3)
        await r.wait(
            lambda: (
                all(
                    not double.get("pods", NAMESPACE, n)["spec"].get("schedulingGates")
                    for n in names_
                )
                if len(r.pods("gang")) == 3
                else False
            ),
            "every gate off",
        )
        writes = [
            (q.verb, q.name)
            for q in double.requests
            if q.resource == "pods" and q.verb in ("create", "patch")
        ]
        creates = [i for i, (verb, _) in enumerate(writes) if verb == "create"]
        patches = [i for i, (verb, _) in enumerate(writes) if verb == "patch"]
        assert len(creates) == 3 and max(creates) < min(patches)
        for i, n in enumerate(names_):
            env = {
                e["name"]: e["value"]
                for e in double.get("pods", NAMESPACE, n)["spec"]["containers"][0]["env"]
            }
            assert env["RANK"] == str(i) and env["WORLD_SIZE"] == "3"
            assert env["MASTER_ADDR"].startswith("r0.qm-gang-")
        assert double.find("services", NAMESPACE, r.pods("gang")[0]["spec"]["subdomain"])
        double.pod_running(NAMESPACE, names_[0], node="gpu-0")
        double.pod_running(NAMESPACE, names_[1], node="gpu-1")
        await r.wait(
            lambda: (
                len(
                    [
                        p
                        for p in r.backend.gangs[("gang", 1)].pods.values()
                        if p["status"].get("phase") == "Running"
                    ]
                )
                == 2
            ),
            "two replicas seen running",
        )
        assert r.events("JobStarted") == []  # two of three is not the gang
        double.pod_running(NAMESPACE, names_[2], node="gpu-2")
        started = await r.wait_event("JobStarted", "gang")
        assert started.payload["nodes"] == ["gpu-0", "gpu-1", "gpu-2"]


async def test_the_cluster_runs_a_gang_on_the_chosen_nodes(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    """With the double playing kube-scheduler and kubelet: the node selector and the
    tolerations take the pods to the chosen (tainted) nodes, and the gang starts."""
    double = kube_api.double
    create_namespace(double)
    for n in ("gpu-0", "gpu-1", "gpu-2"):
        add_gpu_node(double, n)
    double.auto_kubelet()
    async with rig(kube_api) as r:
        await r.place(placement("auto", ["gpu-2", "gpu-1"], gpus=4))
        started = await r.wait_event("JobStarted", "auto")
        assert started.payload["nodes"] == ["gpu-1", "gpu-2"]
        bound = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in r.pods("auto")}
        assert bound == dict(zip(r.pod_names("auto", 2), ["gpu-2", "gpu-1"], strict=True))


async def test_a_failed_member_fails_the_run_and_tears_the_gang_down(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    for n in ("gpu-0", "gpu-1"):
        add_gpu_node(double, n)
    async with rig(kube_api) as r:
        await r.place(placement("fails", ["gpu-0", "gpu-1"], gpus=8))
        names_ = await r.wait(
            lambda: r.pod_names("fails", 2) if len(r.pods("fails")) == 2 else None, "pods"
        )
        double.pod_running(NAMESPACE, names_[0], node="gpu-0")
        double.pod_running(NAMESPACE, names_[1], node="gpu-1")
        await r.wait_event("JobStarted", "fails")
        double.pod_failed(NAMESPACE, names_[1], exit_code=3)
        failed = await r.wait_event("RunFailed", "fails")
        assert failed.payload["reason_code"] == "application_error"
        assert failed.payload["exit_code"] == 3
        assert names_[1] in failed.payload["message"]
        await r.wait(
            lambda: {d.name for d in double.deletions if d.resource == "pods"} >= set(names_),
            "both pods deleted",
        )
        assert r.book.by_job == {}
        assert r.events("JobFinished") == []


@pytest.mark.parametrize(
    ("hook", "kwargs", "reason_code", "exit_code"),
    [
        ("pod_oom_killed", {}, "out_of_memory", 137),
        ("pod_waiting", {"reason": "ImagePullBackOff"}, "image_pull_error", None),
        ("pod_waiting", {"reason": "ErrImagePull"}, "image_pull_error", None),
        ("pod_evicted", {}, "evicted", None),
        ("pod_rejected", {"reason": "UnexpectedAdmissionError"}, "admission_error", None),
    ],
)
async def test_failures_are_classified(
    kube_api: RunningDouble,  # noqa: F811
    hook: str,
    kwargs: dict[str, str],
    reason_code: str,
    exit_code: int | None,
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    async with rig(kube_api) as r:
        await r.place(placement("bad", ["gpu-0"]))
        (name,) = await r.wait(
            lambda: [
                p["metadata"]["name"] for p in r.pods("bad") if not p["spec"].get("schedulingGates")
            ],
            "the pod ungated",
        )
        double.bind_pod(NAMESPACE, name, "gpu-0")
        if hook != "pod_waiting":
            double.pod_running(NAMESPACE, name)
            await r.wait_event("JobStarted", "bad")
        getattr(double, hook)(NAMESPACE, name, **kwargs)
        failed = await r.wait_event("RunFailed", "bad")
        assert failed.payload["reason_code"] == reason_code
        assert failed.payload.get("exit_code") == exit_code
        await r.wait(lambda: any(d.name == name for d in double.deletions), "the pod deleted")


async def test_max_runtime_ends_the_job(kube_api: RunningDouble) -> None:  # noqa: F811
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    async with rig(kube_api) as r:
        await r.place(placement("slow", ["gpu-0"], max_runtime_s=90.5))
        (pod,) = await r.wait(lambda: r.pods("slow"), "the pod")
        assert pod["spec"]["activeDeadlineSeconds"] == 91
        name = pod["metadata"]["name"]
        double.pod_running(NAMESPACE, name, node="gpu-0")
        await r.wait_event("JobStarted", "slow")
        double.pod_rejected(NAMESPACE, name, reason="DeadlineExceeded")
        finished = await r.wait_event("JobFinished", "slow")
        assert finished.payload["outcome"] == "failed"
        assert finished.payload["reason_code"] == "max_runtime_exceeded"


async def test_a_gang_runs_without_its_budget_when_the_role_forbids_one(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    """The disruption budget protects a gang; a cluster whose role does not grant it (403)
    still runs the gang, and deleting it later is no error either."""
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    double.inject_fault("create", "poddisruptionbudgets", status=403, times=None)
    double.auto_kubelet()
    async with rig(kube_api) as r:
        await r.place(placement("job-1", ["gpu-0"], gpus=2))
        await r.wait_event("JobStarted", "job-1")
        assert double.objects("poddisruptionbudgets", NAMESPACE) == []
        (pod,) = r.pods("job-1")
        double.pod_succeeded(NAMESPACE, pod["metadata"]["name"])
        finished = await r.wait_event("JobFinished", "job-1")
        assert finished.payload["outcome"] == "succeeded"
