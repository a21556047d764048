"""The contract between the kubernetes backend and the Kubernetes API: the objects it builds
are accepted, created twice they conflict (409), the gang's gate comes off with a merge patch
and cannot be put back, its selector finds exactly the gang, a watch from the list's version
sees the changes, and the gang can be deleted. Runs against the API double
always, and against a real cluster as well when KUBECONFIG is set (in a throwaway namespace)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import config
from kubernetes_asyncio.client import ApiClient, Configuration, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.watch import Watch

from services.executor.kube import names
from services.executor.kube.names import GangNames, gang_selector
from services.executor.kube.pods import PodOptions, build_pod, build_service
from tests.integration.kube_rig import (
    NAMESPACE,
    add_gpu_node,
    create_namespace,
    granted,
    placement,
    rig,
)
from tests.kubeapi import RunningDouble, serve_double
from tests.kubeapi.fixtures import kube_api  # noqa: F401

TARGETS = ["double"] + (["cluster"] if os.environ.get("KUBECONFIG") else [])


@pytest.fixture(params=TARGETS)
async def api(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, str]]:
    """(CoreV1Api, namespace) on the double, or on the KUBECONFIG cluster."""
    namespace = f"qm-contract-{uuid.uuid4().hex[:8]}"
    body = {"metadata": {"name": namespace}}
    if request.param == "double":
        async with serve_double() as kube, ApiClient(Configuration(host=kube.url)) as client:
            core: Any = CoreV1Api(client)
            await core.create_namespace(body)
            yield core, namespace
        return
    configuration = Configuration()
    await config.load_kube_config(client_configuration=configuration, persist_config=False)
    async with ApiClient(configuration) as client:
        core = CoreV1Api(client)
        await core.create_namespace(body)
        try:
            yield core, namespace
        finally:
            await core.delete_namespace(namespace)


def gang_objects(namespace: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    p = placement(
        "Contract:Job." + "x" * 50,  # not a label value: hashed, kept raw in an annotation
        ["n0", "n1"],
        gpus=2,
        queue="batch",
        command=("python", "-c", "print('hi')"),
        max_runtime_s=600,
    )
    options = PodOptions(namespace=namespace, cluster="contract")
    p = p.model_copy(update={"cluster": "contract"})
    pods = [build_pod(p, r, f"host-{r.node_id}", options) for r in p.replicas]
    return build_service(p, options), pods


async def test_the_backend_objects_against_the_api(api: tuple[Any, str]) -> None:
    core, namespace = api
    service, pods = gang_objects(namespace)
    await core.create_namespaced_service(namespace, service)
    for pod in pods:
        await core.create_namespaced_pod(namespace, pod)
    for pod in pods:  # a redelivered launch
        with pytest.raises(ApiException) as again:
            await core.create_namespaced_pod(namespace, pod)
        assert again.value.status == 409

    job_id = pods[0]["metadata"]["annotations"][names.JOB]
    selector = gang_selector("contract", job_id, 1)
    listed = json.loads(
        await (
            await core.list_namespaced_pod(
                namespace, label_selector=selector, _preload_content=False
            )
        ).read()
    )
    assert sorted(p["metadata"]["name"] for p in listed["items"]) == [
        GangNames(job_id, 1).pod(0),
        GangNames(job_id, 1).pod(1),
    ]
    version = listed["metadata"]["resourceVersion"]

    for pod in pods:
        await core.patch_namespaced_pod(
            pod["metadata"]["name"],
            namespace,
            {"spec": {"schedulingGates": None}},
            _content_type="application/merge-patch+json",
        )
    with pytest.raises(ApiException) as gated:
        await core.patch_namespaced_pod(
            pods[0]["metadata"]["name"],
            namespace,
            {"spec": {"schedulingGates": [{"name": names.GATE}]}},
            _content_type="application/merge-patch+json",
        )
    assert gated.value.status == 422

    ungated: set[str] = set()
    watch = Watch()
    try:
        async with asyncio.timeout(30):
            async for event in watch.stream(
                core.list_namespaced_pod,
                namespace,
                label_selector=selector,
                resource_version=version,
            ):
                raw = event["raw_object"]
                if event["type"] == "MODIFIED" and not raw["spec"].get("schedulingGates"):
                    ungated.add(raw["metadata"]["name"])
                if len(ungated) == 2:
                    break
    finally:
        await watch.close()

    for pod in pods:  # one by one, as the backend deletes (its role has no deletecollection)
        await core.delete_namespaced_pod(pod["metadata"]["name"], namespace, grace_period_seconds=0)
    await core.delete_namespaced_service(service["metadata"]["name"], namespace)
    left = (await core.list_namespaced_pod(namespace, label_selector=selector)).items
    assert all(p.metadata.deletion_timestamp for p in left)  # gone, or on their way


async def test_the_backend_asks_only_what_its_role_grants(kube_api: RunningDouble) -> None:  # noqa: F811
    """A whole lifecycle — launch, run, checkpoint, preempt, a failed gang, a refused
    placement, a quarantine and its end — uses only the verbs deploy/k8s grants the executor."""
    double = kube_api.double
    create_namespace(double)
    for n in ("gpu-0", "gpu-1"):
        add_gpu_node(double, n)
    double.auto_kubelet()
    async with rig(kube_api, unschedulable_after_s=0) as r:
        await r.place(placement("one", ["gpu-0"], gpus=2))
        await r.wait_event("JobStarted", "one")
        await r.checkpoint("one")
        await r.preempt("one")
        await r.place(placement("two", ["gpu-1"], gpus=2))
        await r.wait_event("JobStarted", "two")
        double.pod_failed(NAMESPACE, r.pod_names("two", 1)[0])
        await r.wait_event("RunFailed", "two")
        await r.place(placement("big", ["gpu-1"], gpus=64))
        await r.wait_event("PlacementRefused", "big")
        await r.node_unhealthy("gpu-0")
        await r.node_recovered("gpu-0")
        await r.wait(
            lambda: not double.get("nodes", None, "gpu-0")["spec"].get("unschedulable"),
            "the quarantine over",
        )
        await r.backend.actions.join()
    asked = {(q.verb, q.resource.split("/")[0]) for q in double.requests}
    assert asked - granted() == set()
