"""The Kubernetes API double, driven only through the real kubernetes-asyncio client over HTTP.

The hooks (`kube_api.double`) play kubelet, scheduler and controllers and inject faults; every
assertion about the API is made through CoreV1Api, CustomObjectsApi, CoordinationV1Api and
`watch.Watch`, as the executor backend will see it. Nothing waits on time: tests wait for
conditions (an open watch, an event count) with generous timeouts.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client import ApiClient, ApiException

from tests.kubeapi import (
    KubeApiDouble,
    RunningDouble,
    api_client_for,
    run_in_thread,
    serve_double,
    write_kubeconfig,
)

NS = "default"
PR_GROUP, PR_VERSION, PR_PLURAL = "autoscaling.x-k8s.io", "v1", "provisioningrequests"
MERGE = "application/merge-patch+json"


def pod(name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": "registry.example/trainer:1.0"}
    return {
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"containers": [container], "restartPolicy": "Never", **spec},
    }


def status_of(error: ApiException) -> dict[str, Any]:
    return json.loads(error.body)


async def until(predicate: Callable[[], Any], within_s: float = 30.0) -> None:
    """Wait for a condition (never for a fixed time); the conditions span client and server."""
    async with asyncio.timeout(within_s):
        while not predicate():  # noqa: ASYNC110 (polling plain state on both sides)
            await asyncio.sleep(0.005)


class Collector:
    """A kubernetes-asyncio watch running in a task, keeping every event it yields."""

    def __init__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.watch = watch.Watch()
        self.events: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.task = asyncio.create_task(self._run(func, args, kwargs))

    async def _run(self, func: Callable[..., Any], args: Any, kwargs: Any) -> None:
        try:
            async for event in self.watch.stream(func, *args, **kwargs):
                self.events.append(event)
        except Exception as error:  # kept for the test to assert on
            self.error = error

    async def wait(self, count: int) -> None:
        await until(lambda: len(self.events) >= count or self.error is not None)

    def seen(self) -> list[tuple[str, str]]:
        return [(e["type"], e["raw_object"]["metadata"].get("name", "")) for e in self.events]

    async def close(self) -> None:
        self.watch.stop()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.watch.close()


@pytest.fixture
def double(kube_api: RunningDouble) -> KubeApiDouble:
    return kube_api.double


@pytest.fixture
def core(kube_client: ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


@pytest.fixture
def custom(kube_client: ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(kube_client)


# --- discovery, create, get, list -----------------------------------------------------------


async def test_discovery_answers_the_client(kube_client: ApiClient) -> None:
    versions = await client.CoreApi(kube_client).get_api_versions()
    assert versions.versions == ["v1"]
    groups = await client.ApisApi(kube_client).get_api_versions()
    assert {"coordination.k8s.io", PR_GROUP} <= {g.name for g in groups.groups}
    core = await client.CoreV1Api(kube_client).get_api_resources()
    names = {r.name for r in core.resources}
    assert {"pods", "pods/status", "nodes", "services", "events", "configmaps"} <= names
    leases = await client.CoordinationV1Api(kube_client).get_api_resources()
    assert [r.name for r in leases.resources] == ["leases"]
    version = await client.VersionApi(kube_client).get_code()
    assert version.major == "1"


async def test_create_get_and_metadata(core: client.CoreV1Api) -> None:
    created, code, _ = await core.create_namespaced_pod_with_http_info(NS, pod("a"))
    assert code == 201
    meta = created.metadata
    assert meta.uid and meta.creation_timestamp and meta.generation == 1
    assert meta.namespace == NS and created.status.phase == "Pending"
    second = await core.create_namespaced_pod(NS, pod("b"))
    assert int(second.metadata.resource_version) > int(meta.resource_version)
    fetched = await core.read_namespaced_pod("a", NS)
    assert fetched.metadata.uid == meta.uid
    assert fetched.spec.termination_grace_period_seconds == 30  # defaulted as the API does


async def test_not_found_and_already_exists_are_status_objects(core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as missing:
        await core.read_namespaced_pod("nope", NS)
    status = status_of(missing.value)
    assert missing.value.status == 404
    assert status["kind"] == "Status" and status["apiVersion"] == "v1"
    assert status["status"] == "Failure" and status["reason"] == "NotFound"
    assert status["message"] == 'pods "nope" not found' and status["code"] == 404
    await core.create_namespaced_pod(NS, pod("a"))
    with pytest.raises(ApiException) as duplicate:
        await core.create_namespaced_pod(NS, pod("a"))
    assert duplicate.value.status == 409
    assert status_of(duplicate.value)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as no_namespace:
        await core.create_namespaced_pod("ghost", pod("a"))
    assert status_of(no_namespace.value)["message"] == 'namespaces "ghost" not found'


async def test_generate_name_and_invalid_objects(core: client.CoreV1Api) -> None:
    body = pod("")
    body["metadata"] = {"generateName": "trainer-"}
    created = await core.create_namespaced_pod(NS, body)
    assert created.metadata.name.startswith("trainer-") and len(created.metadata.name) == 13
    invalid_bodies = {
        "metadata.name": {"metadata": {}, "spec": pod("x")["spec"]},
        "metadata.labels": pod("x", labels={"job": "tenant/a b"}),
        "spec.containers[0].image": {
            "metadata": {"name": "x"},
            "spec": {"containers": [{"name": "main"}]},
        },
    }
    for field, body in invalid_bodies.items():
        with pytest.raises(ApiException) as error:
            await core.create_namespaced_pod(NS, body)
        status = status_of(error.value)
        assert error.value.status == 422 and status["reason"] == "Invalid"
        assert status["details"]["causes"][0]["field"] == field


async def test_extended_resources_must_be_whole_and_equal(core: client.CoreV1Api) -> None:
    half = pod("half")
    half["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "500m"}}
    with pytest.raises(ApiException) as error:
        await core.create_namespaced_pod(NS, half)
    assert "must be an integer" in status_of(error.value)["message"]
    whole = pod("whole")
    whole["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "2"}}
    created = await core.create_namespaced_pod(NS, whole)
    assert created.spec.containers[0].resources.requests == {"nvidia.com/gpu": "2"}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=trainer", {"t1", "t2"}),
        ("app==trainer,tier=gpu", {"t1"}),
        ("app!=trainer", {"s1", "bare"}),
        ("tier in (gpu,tpu)", {"t1", "s1"}),
        ("tier notin (gpu)", {"t2", "s1", "bare"}),
        ("tier", {"t1", "t2", "s1"}),
        ("!tier", {"bare"}),
    ],
)
async def test_label_selectors(core: client.CoreV1Api, selector: str, expected: set[str]) -> None:
    labels = {
        "t1": {"app": "trainer", "tier": "gpu"},
        "t2": {"app": "trainer", "tier": "cpu"},
        "s1": {"app": "server", "tier": "tpu"},
        "bare": {},
    }
    for name, pod_labels in labels.items():
        await core.create_namespaced_pod(NS, pod(name, labels=pod_labels))
    listed = await core.list_namespaced_pod(NS, label_selector=selector)
    assert {p.metadata.name for p in listed.items} == expected


async def test_field_selectors(core: client.CoreV1Api, double: KubeApiDouble) -> None:
    double.add_node("node-a")
    for name in ("p1", "p2", "p3"):
        await core.create_namespaced_pod(NS, pod(name))
    double.pod_running(NS, "p1", node="node-a")
    double.bind_pod(NS, "p2", "node-a")

    async def names(selector: str) -> set[str]:
        listed = await core.list_namespaced_pod(NS, field_selector=selector)
        return {p.metadata.name for p in listed.items}

    assert await names("metadata.name=p2") == {"p2"}
    assert await names("spec.nodeName=node-a") == {"p1", "p2"}
    assert await names("spec.nodeName=") == {"p3"}
    assert await names("status.phase=Running") == {"p1"}
    assert await names("status.phase!=Running,metadata.namespace=default") == {"p2", "p3"}
    with pytest.raises(ApiException) as error:
        await names("spec.image=x")
    assert error.value.status == 400
    assert "field label not supported" in status_of(error.value)["message"]


async def test_list_across_namespaces_cluster_scope_and_paging(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    await core.create_namespace({"metadata": {"name": "team-a"}})
    await core.create_namespaced_pod("team-a", pod("x"))
    await core.create_namespaced_pod(NS, pod("y"))
    everywhere = await core.list_pod_for_all_namespaces()
    assert {(p.metadata.namespace, p.metadata.name) for p in everywhere.items} == {
        ("team-a", "x"),
        (NS, "y"),
    }
    assert everywhere.metadata.resource_version == double.resource_version
    double.add_node("n1")
    double.add_node("n2")
    double.cordon_node("n2")
    cordoned = await core.list_node(field_selector="spec.unschedulable=true")
    assert [n.metadata.name for n in cordoned.items] == ["n2"]
    first = await core.list_pod_for_all_namespaces(limit=1)
    assert len(first.items) == 1 and first.metadata.remaining_item_count == 1
    rest = await core.list_pod_for_all_namespaces(limit=1, _continue=first.metadata._continue)
    assert {first.items[0].metadata.name, rest.items[0].metadata.name} == {"x", "y"}


# --- updates, conflicts, patches, status --------------------------------------------------


async def test_replace_with_a_stale_resource_version_conflicts(core: client.CoreV1Api) -> None:
    stale = await core.create_namespaced_config_map(
        NS, {"metadata": {"name": "policy"}, "data": {"k": "1"}}
    )
    fresh = await core.read_namespaced_config_map("policy", NS)
    fresh.data = {"k": "2"}
    updated = await core.replace_namespaced_config_map("policy", NS, fresh)
    assert updated.data == {"k": "2"} and updated.metadata.generation == 2
    stale.data = {"k": "3"}
    with pytest.raises(ApiException) as error:
        await core.replace_namespaced_config_map("policy", NS, stale)
    status = status_of(error.value)
    assert error.value.status == 409 and status["reason"] == "Conflict"
    assert "the object has been modified" in status["message"]
    stale.metadata.resource_version = None  # no resourceVersion: an unconditional update
    assert (await core.replace_namespaced_config_map("policy", NS, stale)).data == {"k": "3"}


async def test_merge_patch_and_its_resource_version_precondition(core: client.CoreV1Api) -> None:
    created = await core.create_namespaced_pod(NS, pod("a", labels={"keep": "1", "drop": "1"}))
    body = {"metadata": {"labels": {"drop": None, "new": "1"}}}
    patched = await core.patch_namespaced_pod("a", NS, body, _content_type=MERGE)
    assert patched.metadata.labels == {"keep": "1", "new": "1"}
    stale = {
        "metadata": {"resourceVersion": created.metadata.resource_version, "labels": {"x": "1"}}
    }
    with pytest.raises(ApiException) as error:
        await core.patch_namespaced_pod("a", NS, stale, _content_type=MERGE)
    assert error.value.status == 409


async def test_strategic_merge_patch_is_the_default_for_dicts(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    double.add_node("n1", taints=[{"key": "a", "effect": "NoSchedule"}])
    patch = {"spec": {"unschedulable": True, "taints": [{"key": "b", "effect": "NoSchedule"}]}}
    node = await core.patch_node("n1", patch)
    assert node.spec.unschedulable is True
    assert [t.key for t in node.spec.taints] == ["b"]  # taints have no merge key: replaced
    await core.create_namespaced_pod(NS, pod("a"))
    await core.patch_namespaced_pod("a", NS, {"metadata": {"finalizers": ["qm.io/one"]}})
    both = await core.patch_namespaced_pod("a", NS, {"metadata": {"finalizers": ["qm.io/two"]}})
    assert both.metadata.finalizers == ["qm.io/one", "qm.io/two"]  # merged as a set
    condition = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}
    double.pod_running(NS, "a", node="n1")
    patched = await core.patch_namespaced_pod_status(
        "a", NS, {"status": {"conditions": [condition]}}
    )
    types = [c.type for c in patched.status.conditions]
    assert "DisruptionTarget" in types and "Ready" in types  # conditions merge by type
    first_patch = next(r for r in double.requests if r.verb == "patch")
    assert first_patch.content_type == "application/strategic-merge-patch+json"


async def test_strategic_merge_patch_merges_containers_by_name(core: client.CoreV1Api) -> None:
    body = pod("a")
    body["spec"]["containers"].append({"name": "sidecar", "image": "proxy:1"})
    await core.create_namespaced_pod(NS, body)
    patch = {"spec": {"containers": [{"name": "sidecar", "image": "proxy:2"}]}}
    patched = await core.patch_namespaced_pod("a", NS, patch)
    images = {c.name: c.image for c in patched.spec.containers}
    assert images == {"main": "registry.example/trainer:1.0", "sidecar": "proxy:2"}


async def test_services_events_and_their_selectors(core: client.CoreV1Api) -> None:
    headless = {
        "metadata": {"name": "gang-1"},
        "spec": {"clusterIP": "None", "selector": {"gang": "1"}},
    }
    service = await core.create_namespaced_service(NS, headless)
    assert service.spec.cluster_ip == "None"
    plain = await core.create_namespaced_service(NS, {"metadata": {"name": "api"}, "spec": {}})
    assert plain.spec.cluster_ip.startswith("10.96.")
    for name, reason in (("e1", "Preempted"), ("e2", "Scheduled")):
        event = {
            "metadata": {"name": name},
            "reason": reason,
            "involvedObject": {"kind": "Pod", "name": "worker-0", "namespace": NS},
        }
        await core.create_namespaced_event(NS, event)
    found = await core.list_namespaced_event(
        NS, field_selector="involvedObject.name=worker-0,reason=Preempted"
    )
    assert [e.metadata.name for e in found.items] == ["e1"]


async def test_json_patch_removes_a_scheduling_gate(core: client.CoreV1Api) -> None:
    gated = pod("a", schedulingGates=[{"name": "quartermaster.io/gang"}])
    await core.create_namespaced_pod(NS, gated)
    failing = [
        {"op": "test", "path": "/spec/schedulingGates/0/name", "value": "other"},
        {"op": "remove", "path": "/spec/schedulingGates/0"},
    ]
    with pytest.raises(ApiException) as error:
        await core.patch_namespaced_pod("a", NS, failing)
    assert error.value.status == 422
    ops = [
        {"op": "test", "path": "/spec/schedulingGates/0/name", "value": "quartermaster.io/gang"},
        {"op": "remove", "path": "/spec/schedulingGates"},
        {"op": "add", "path": "/metadata/labels/attempt", "value": "2"},
        {"op": "replace", "path": "/metadata/labels/attempt", "value": "3"},
    ]
    ungated = await core.patch_namespaced_pod("a", NS, ops)
    assert ungated.spec.scheduling_gates is None and ungated.metadata.labels == {"attempt": "3"}
    regate = [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": "again"}]}]
    with pytest.raises(ApiException) as forbidden:
        await core.patch_namespaced_pod("a", NS, regate)
    assert "only deletion is allowed" in status_of(forbidden.value)["message"]


async def test_pod_spec_is_immutable_but_apply_is_refused_clearly(core: client.CoreV1Api) -> None:
    await core.create_namespaced_pod(NS, pod("a"))
    with pytest.raises(ApiException) as error:
        await core.patch_namespaced_pod("a", NS, {"spec": {"nodeName": "elsewhere"}})
    assert error.value.status == 422 and "may not change fields" in error.value.body
    with pytest.raises(ApiException) as apply:
        await core.patch_namespaced_pod(
            "a",
            NS,
            {"metadata": {"labels": {"a": "b"}}},
            _content_type="application/apply-patch+yaml",
        )
    assert apply.value.status == 415
    assert status_of(apply.value)["reason"] == "UnsupportedMediaType"


async def test_status_subresource_separates_spec_and_status(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    await core.create_namespaced_pod(NS, pod("a"))
    current = await core.read_namespaced_pod("a", NS)
    current.status.phase = "Running"
    current.metadata.labels = {"sneaky": "yes"}
    written = await core.replace_namespaced_pod_status("a", NS, current)
    assert written.status.phase == "Running" and not written.metadata.labels  # status only
    ignored = await core.patch_namespaced_pod(
        "a", NS, {"status": {"phase": "Failed"}, "metadata": {"labels": {"seen": "yes"}}}
    )
    assert ignored.status.phase == "Running" and ignored.metadata.labels == {"seen": "yes"}
    assert double.get("pods", NS, "a")["status"]["phase"] == "Running"


async def test_custom_resource_status_and_patch_types(custom: client.CustomObjectsApi) -> None:
    body = {
        "apiVersion": f"{PR_GROUP}/{PR_VERSION}",
        "kind": "ProvisioningRequest",
        "metadata": {"name": "gang-1"},
        "spec": {"podSets": []},
        "status": {"conditions": []},
    }
    created = await custom.create_namespaced_custom_object(
        PR_GROUP, PR_VERSION, NS, PR_PLURAL, body
    )
    assert created["metadata"]["uid"] and "status" not in created  # status only via /status
    provisioned = {"status": {"conditions": [{"type": "Provisioned", "status": "True"}]}}
    written = await custom.patch_namespaced_custom_object_status(
        PR_GROUP, PR_VERSION, NS, PR_PLURAL, "gang-1", provisioned, _content_type=MERGE
    )
    assert written["status"]["conditions"][0]["type"] == "Provisioned"
    with pytest.raises(ApiException) as default_type:
        # CustomObjectsApi sends a dict as application/json-patch+json unless told otherwise.
        await custom.patch_namespaced_custom_object(
            PR_GROUP, PR_VERSION, NS, PR_PLURAL, "gang-1", {"spec": {"podSets": [1]}}
        )
    assert default_type.value.status == 400
    with pytest.raises(ApiException) as strategic:
        await custom.patch_namespaced_custom_object(
            PR_GROUP,
            PR_VERSION,
            NS,
            PR_PLURAL,
            "gang-1",
            {"spec": {}},
            _content_type="application/strategic-merge-patch+json",
        )
    assert strategic.value.status == 415
    listed = await custom.list_namespaced_custom_object(PR_GROUP, PR_VERSION, NS, PR_PLURAL)
    assert [i["metadata"]["name"] for i in listed["items"]] == ["gang-1"]


async def test_leases_take_turns_through_conflicts(kube_client: ApiClient) -> None:
    leases = client.CoordinationV1Api(kube_client)
    body = {
        "metadata": {"name": "scheduler"},
        "spec": {"holderIdentity": "replica-1", "leaseDurationSeconds": 15},
    }
    mine = await leases.create_namespaced_lease(NS, body)
    theirs = await leases.read_namespaced_lease("scheduler", NS)
    theirs.spec.holder_identity = "replica-2"
    await leases.replace_namespaced_lease("scheduler", NS, theirs)
    mine.spec.holder_identity = "replica-1-again"
    with pytest.raises(ApiException) as error:
        await leases.replace_namespaced_lease("scheduler", NS, mine)
    assert error.value.status == 409
    held = await leases.read_namespaced_lease("scheduler", NS)
    assert held.spec.holder_identity == "replica-2"


async def test_a_write_that_changes_nothing_is_not_an_event(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    await core.create_namespaced_config_map(NS, {"metadata": {"name": "c"}, "data": {"a": "1"}})
    before = double.resource_version
    same = await core.patch_namespaced_config_map("c", NS, {"data": {"a": "1"}})
    assert same.metadata.resource_version == before == double.resource_version
    relabelled = await core.patch_namespaced_config_map(
        "c", NS, {"metadata": {"labels": {"x": "y"}}}
    )
    assert relabelled.metadata.generation == 1  # metadata is not spec


# --- deletion ------------------------------------------------------------------------------


async def test_pod_delete_honours_the_grace_period(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    double.add_node("n1")
    await core.create_namespaced_pod(NS, pod("a", terminationGracePeriodSeconds=7))
    await core.create_namespaced_pod(NS, pod("b"))
    double.pod_running(NS, "a", node="n1")
    double.pod_running(NS, "b", node="n1")
    marked = await core.delete_namespaced_pod("a", NS, grace_period_seconds=45)
    assert marked.metadata.deletion_timestamp is not None
    assert marked.metadata.deletion_grace_period_seconds == 45
    assert (await core.read_namespaced_pod("a", NS)).metadata.deletion_grace_period_seconds == 45
    by_default = await core.delete_namespaced_pod("b", NS)
    assert by_default.metadata.deletion_grace_period_seconds == 30
    assert [(d.name, d.requested_grace_seconds, d.grace_seconds) for d in double.deletions] == [
        ("a", 45, 45),
        ("b", None, 30),
    ]
    shortened = await core.delete_namespaced_pod("b", NS, body={"gracePeriodSeconds": 5})
    assert shortened.metadata.deletion_grace_period_seconds == 5
    double.finish_pod_termination(NS, "a")  # the kubelet stops the containers and deletes
    with pytest.raises(ApiException) as gone:
        await core.read_namespaced_pod("a", NS)
    assert gone.value.status == 404
    await core.delete_namespaced_pod("b", NS, grace_period_seconds=0)
    assert (await core.list_namespaced_pod(NS)).items == []


async def test_unscheduled_pods_go_at_once(core: client.CoreV1Api, double: KubeApiDouble) -> None:
    await core.create_namespaced_pod(NS, pod("pending"))
    await core.delete_namespaced_pod("pending", NS, grace_period_seconds=60)
    assert double.find("pods", NS, "pending") is None
    assert double.deletions[0].grace_seconds == 0


async def test_finalizers_hold_a_deleted_object(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    body = {"metadata": {"name": "c", "finalizers": ["quartermaster.io/ledger"]}}
    await core.create_namespaced_config_map(NS, body)
    await core.delete_namespaced_config_map("c", NS)
    held = await core.read_namespaced_config_map("c", NS)
    assert held.metadata.deletion_timestamp is not None
    with pytest.raises(ApiException) as error:
        await core.patch_namespaced_config_map("c", NS, {"metadata": {"finalizers": ["x.io/y"]}})
    assert error.value.status == 422
    await core.patch_namespaced_config_map(
        "c", NS, [{"op": "remove", "path": "/metadata/finalizers"}]
    )
    assert double.find("configmaps", NS, "c") is None


async def test_delete_collection_by_label(core: client.CoreV1Api) -> None:
    for index in range(4):
        await core.create_namespaced_pod(NS, pod(f"p{index}", labels={"job": str(index % 2)}))
    await core.delete_collection_namespaced_pod(NS, label_selector="job=0")
    left = await core.list_namespaced_pod(NS)
    assert sorted(p.metadata.name for p in left.items) == ["p1", "p3"]


async def test_namespace_delete_removes_its_contents(core: client.CoreV1Api) -> None:
    await core.create_namespace({"metadata": {"name": "tenant-x"}})
    await core.create_namespaced_pod("tenant-x", pod("a"))
    await core.delete_namespace("tenant-x")
    assert (await core.list_pod_for_all_namespaces()).items == []


# --- watches ------------------------------------------------------------------------------


async def test_a_dropped_watch_resumes_without_losing_or_repeating(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    await core.create_namespaced_pod(NS, pod("before"))
    listed = await core.list_namespaced_pod(NS)
    events = Collector(
        core.list_namespaced_pod, NS, resource_version=listed.metadata.resource_version
    )
    try:
        await until(lambda: double.watcher_count("pods") == 1)
        for name in ("p1", "p2"):
            await core.create_namespaced_pod(NS, pod(name))
        await events.wait(2)
        double.drop_watches()
        # Written before the client can reconnect (this runs on the server's loop, without
        # yielding): only the resumed watch's replay can deliver it.
        double.create("pods", NS, pod("p3"))
        await until(lambda: double.watcher_count("pods") == 1)
        await core.patch_namespaced_pod("p1", NS, {"metadata": {"labels": {"a": "b"}}})
        await core.delete_namespaced_pod("p2", NS)
        await events.wait(5)
        assert events.seen() == [
            ("ADDED", "p1"),
            ("ADDED", "p2"),
            ("ADDED", "p3"),
            ("MODIFIED", "p1"),
            ("DELETED", "p2"),
        ]
        versions = [int(e["raw_object"]["metadata"]["resourceVersion"]) for e in events.events]
        assert versions == sorted(set(versions))
        watches = [r.query for r in double.requests if r.verb == "watch"]
        assert len(watches) == 2 and watches[1]["resourceVersion"] == str(versions[1])
        assert watches[0]["watch"] == "True"  # what kubernetes-asyncio sends
    finally:
        await events.close()


async def test_a_watch_from_a_compacted_version_gets_410(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    await core.create_namespaced_pod(NS, pod("a"))
    old = double.resource_version
    await core.create_namespaced_pod(NS, pod("b"))
    double.compact()
    stream = watch.Watch().stream(
        core.list_namespaced_pod, NS, resource_version=old, timeout_seconds=30
    )
    with pytest.raises(ApiException) as error:
        async for _ in stream:
            pass
    assert error.value.status == 410 and "too old resource version" in error.value.reason
    # Without timeout_seconds the client retries once from the same version, then raises too.
    forever = watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=old)
    with pytest.raises(ApiException) as again:
        async for _ in forever:
            pass
    assert again.value.status == 410
    # The cure, as the backend must do it: list again and watch from the list's version.
    relisted = await core.list_namespaced_pod(NS)
    events = Collector(
        core.list_namespaced_pod, NS, resource_version=relisted.metadata.resource_version
    )
    try:
        await until(lambda: double.watcher_count("pods") == 1)
        await core.create_namespaced_pod(NS, pod("c"))
        await events.wait(1)
        assert events.seen() == [("ADDED", "c")]
    finally:
        await events.close()


async def test_history_window_expires_old_versions() -> None:
    async with serve_double(history_window=3) as kube, kube.api_client() as api:
        core = client.CoreV1Api(api)
        first = await core.create_namespaced_pod(NS, pod("p0"))
        for index in range(1, 5):
            await core.create_namespaced_pod(NS, pod(f"p{index}"))
        stream = watch.Watch().stream(
            core.list_namespaced_pod,
            NS,
            timeout_seconds=30,
            resource_version=first.metadata.resource_version,
        )
        with pytest.raises(ApiException) as error:
            async for _ in stream:
                pass
        assert error.value.status == 410


async def test_bookmarks_and_timeout(core: client.CoreV1Api, double: KubeApiDouble) -> None:
    events = Collector(
        core.list_namespaced_pod,
        NS,
        resource_version=double.resource_version,
        allow_watch_bookmarks=True,
        timeout_seconds=3600,
    )
    try:
        await until(lambda: double.watcher_count("pods") == 1)
        await core.create_namespaced_config_map(NS, {"metadata": {"name": "elsewhere"}})
        assert double.send_bookmarks() == 1
        await events.wait(1)
        bookmark = events.events[0]
        assert bookmark["type"] == "BOOKMARK"
        assert bookmark["raw_object"]["metadata"]["resourceVersion"] == double.resource_version
        assert events.watch.resource_version == double.resource_version  # the client follows
    finally:
        await events.close()
    ended = [
        e
        async for e in watch.Watch().stream(
            core.list_namespaced_pod,
            NS,
            resource_version=double.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=1,
        )
    ]
    assert [e["type"] for e in ended] == ["BOOKMARK"]  # the last word before the timeout


async def test_watch_without_version_starts_with_the_current_state(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    for name in ("a", "b"):
        await core.create_namespaced_pod(NS, pod(name))
    events = Collector(core.list_namespaced_pod, NS)
    try:
        await events.wait(2)
        assert events.seen() == [("ADDED", "a"), ("ADDED", "b")]
    finally:
        await events.close()


async def test_selectors_apply_to_watch_events(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    double.add_node("n1")
    await core.create_namespaced_pod(NS, pod("a"))
    rv = double.resource_version
    by_label = Collector(core.list_namespaced_pod, NS, resource_version=rv, label_selector="qm=1")
    by_node = Collector(
        core.list_namespaced_pod, NS, resource_version=rv, field_selector="spec.nodeName=n1"
    )
    try:
        await until(lambda: double.watcher_count("pods") == 2)
        await core.create_namespaced_pod(NS, pod("other"))  # matches neither
        await core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"qm": "1"}}})
        await core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"qm": "2"}}})
        double.bind_pod(NS, "a", "n1")
        await by_label.wait(2)
        await by_node.wait(1)
        assert by_label.seen() == [("ADDED", "a"), ("DELETED", "a")]
        assert by_node.seen() == [("ADDED", "a")]
    finally:
        await by_label.close()
        await by_node.close()


async def test_custom_resources_can_be_watched(
    custom: client.CustomObjectsApi, double: KubeApiDouble
) -> None:
    events = Collector(
        custom.list_namespaced_custom_object,
        PR_GROUP,
        PR_VERSION,
        NS,
        PR_PLURAL,
        resource_version=double.resource_version,
    )
    try:
        await until(lambda: double.watcher_count(PR_PLURAL) == 1)
        body = {
            "apiVersion": f"{PR_GROUP}/{PR_VERSION}",
            "kind": "ProvisioningRequest",
            "metadata": {"name": "gang-1"},
            "spec": {},
        }
        await custom.create_namespaced_custom_object(PR_GROUP, PR_VERSION, NS, PR_PLURAL, body)
        double.set_status(PR_PLURAL, NS, "gang-1", {"conditions": [{"type": "Provisioned"}]})
        await events.wait(2)
        assert events.seen() == [("ADDED", "gang-1"), ("MODIFIED", "gang-1")]
        assert events.events[1]["object"]["status"]["conditions"][0]["type"] == "Provisioned"
    finally:
        await events.close()


async def test_initial_events_end_with_a_bookmark(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    await core.create_namespaced_pod(NS, pod("a"))
    events = Collector(
        core.list_namespaced_pod,
        NS,
        send_initial_events=True,
        resource_version_match="NotOlderThan",
        allow_watch_bookmarks=True,
    )
    try:
        await events.wait(2)
        assert [e["type"] for e in events.events] == ["ADDED", "BOOKMARK"]
        annotations = events.events[1]["raw_object"]["metadata"]["annotations"]
        assert annotations == {"k8s.io/initial-events-end": "true"}
    finally:
        await events.close()


async def test_an_abruptly_cut_watch_raises_in_the_client(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    events = Collector(core.list_namespaced_pod, NS, resource_version=double.resource_version)
    try:
        await until(lambda: double.watcher_count("pods") == 1)
        double.drop_watches(abrupt=True)
        await until(lambda: events.task.done())
        assert isinstance(events.error, aiohttp.ClientPayloadError)
    finally:
        await events.close()


# --- kubelet, scheduler and node hooks ---------------------------------------------------------


async def test_kubelet_hooks_set_pod_states(core: client.CoreV1Api, double: KubeApiDouble) -> None:
    double.add_node("n1")
    for name in ("run", "done", "oom", "err", "pull", "evicted", "rejected", "nofit"):
        await core.create_namespaced_pod(NS, pod(name))
    double.pod_running(NS, "run", node="n1")
    running = await core.read_namespaced_pod("run", NS)
    assert running.status.phase == "Running" and running.spec.node_name == "n1"
    assert running.status.container_statuses[0].ready is True
    assert running.status.container_statuses[0].state.running.started_at is not None
    assert {c.type: c.status for c in running.status.conditions}["Ready"] == "True"
    assert running.status.pod_ip and running.status.host_ip

    for name in ("done", "oom", "err", "pull", "evicted", "rejected"):
        double.bind_pod(NS, name, "n1")
    double.pod_succeeded(NS, "done")
    double.pod_oom_killed(NS, "oom")
    double.pod_failed(NS, "err", reason="Error", exit_code=1)
    double.pod_waiting(NS, "pull", reason="ErrImagePull")
    double.pod_evicted(NS, "evicted")
    double.pod_rejected(NS, "rejected", "UnexpectedAdmissionError", "Allocate failed")
    double.pod_unschedulable(NS, "nofit", "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")

    async def read(name: str) -> client.V1Pod:
        return await core.read_namespaced_pod(name, NS)

    def terminated(p: client.V1Pod) -> tuple[str, int]:
        state = p.status.container_statuses[0].state.terminated
        return state.reason, state.exit_code

    assert (await read("done")).status.phase == "Succeeded"
    assert terminated(await read("done")) == ("Completed", 0)
    assert terminated(await read("oom")) == ("OOMKilled", 137)
    assert (await read("err")).status.phase == "Failed"
    assert terminated(await read("err")) == ("Error", 1)
    pull = await read("pull")
    assert pull.status.phase == "Pending"
    assert pull.status.container_statuses[0].state.waiting.reason == "ErrImagePull"
    assert (await read("evicted")).status.reason == "Evicted"
    assert (await read("rejected")).status.reason == "UnexpectedAdmissionError"
    nofit = await read("nofit")
    scheduled = next(c for c in nofit.status.conditions if c.type == "PodScheduled")
    assert (scheduled.status, scheduled.reason) == ("False", "Unschedulable")


async def test_node_hooks(core: client.CoreV1Api, double: KubeApiDouble) -> None:
    double.add_node(
        "gpu-a", labels={"quartermaster.io/rack": "r1"}, allocatable={"nvidia.com/gpu": "8"}
    )
    node = await core.read_node("gpu-a")
    assert node.metadata.labels["kubernetes.io/hostname"] == "gpu-a"
    assert node.status.allocatable["nvidia.com/gpu"] == "8"
    double.set_node_ready("gpu-a", False)
    node = await core.read_node("gpu-a")
    ready = next(c for c in node.status.conditions if c.type == "Ready")
    assert ready.status == "False"
    assert "node.kubernetes.io/not-ready" in {t.key for t in node.spec.taints}
    double.set_node_ready("gpu-a", True)
    double.cordon_node("gpu-a")
    double.set_node_allocatable("gpu-a", {"nvidia.com/gpu": "7"})
    node = await core.read_node("gpu-a")
    assert node.spec.unschedulable is True and node.status.allocatable["nvidia.com/gpu"] == "7"
    assert {t.key for t in node.spec.taints} == {"node.kubernetes.io/unschedulable"}


async def test_auto_kubelet_schedules_runs_and_ends_pods(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    double.add_node("gpu-a", allocatable={"nvidia.com/gpu": "8"})
    double.add_node("gpu-b", allocatable={"nvidia.com/gpu": "8"})
    double.auto_kubelet()
    pinned = pod(
        "pinned",
        nodeSelector={"kubernetes.io/hostname": "gpu-b"},
        schedulingGates=[{"name": "quartermaster.io/gang"}],
    )
    pinned["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "8"}}
    events = Collector(core.list_namespaced_pod, NS, resource_version=double.resource_version)
    try:
        await until(lambda: double.watcher_count("pods") == 1)
        await core.create_namespaced_pod(NS, pinned)
        await core.patch_namespaced_pod(
            "pinned", NS, [{"op": "remove", "path": "/spec/schedulingGates"}]
        )
        await until(
            lambda: any(e["raw_object"]["status"].get("phase") == "Running" for e in events.events)
        )
        running = await core.read_namespaced_pod("pinned", NS)
        assert running.spec.node_name == "gpu-b" and running.status.phase == "Running"

        greedy = pod("greedy", nodeSelector={"kubernetes.io/hostname": "gpu-b"})
        greedy["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
        await core.create_namespaced_pod(NS, greedy)
        await core.create_namespaced_pod(NS, pod("lost", nodeSelector={"pool": "tpu"}))

        def unschedulable(name: str) -> str | None:
            found = double.find("pods", NS, name) or {}
            for condition in (found.get("status") or {}).get("conditions") or []:
                if condition["type"] == "PodScheduled" and condition["status"] == "False":
                    return str(condition["message"])
            return None

        await until(lambda: unschedulable("greedy") and unschedulable("lost"))
        assert "Insufficient nvidia.com/gpu" in (unschedulable("greedy") or "")
        assert "didn't match Pod's node affinity/selector" in (unschedulable("lost") or "")

        await core.delete_namespaced_pod("pinned", NS, grace_period_seconds=30)
        # The kubelet ends the pod; the GPUs it held go to the pod that waited for them.
        await until(lambda: ("DELETED", "pinned") in events.seen())
        await until(
            lambda: (
                (double.find("pods", NS, "greedy") or {}).get("status", {}).get("phase")
                == "Running"
            )
        )
        assert double.deletions[0].grace_seconds == 30
    finally:
        await events.close()


# --- faults --------------------------------------------------------------------------------


async def test_injected_errors_answer_the_next_matching_requests(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    double.inject_fault(verb="create", resource="pods", status=503, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as error:
            await core.create_namespaced_pod(NS, pod("a"))
        assert error.value.status == 503
        assert status_of(error.value)["reason"] == "ServiceUnavailable"
    await core.create_namespaced_pod(NS, pod("a"))  # the fault is used up
    double.inject_fault(verb="patch", resource="pods/status", status=429, retry_after=2)
    with pytest.raises(ApiException) as throttled:
        await core.patch_namespaced_pod_status("a", NS, {"status": {"phase": "Running"}})
    assert throttled.value.status == 429 and throttled.value.headers["Retry-After"] == "2"
    double.inject_fault(verb="watch", resource="pods", status=500)
    with pytest.raises(ApiException) as broken:
        async for _ in watch.Watch().stream(core.list_namespaced_pod, NS, timeout_seconds=30):
            pass
    assert broken.value.status == 500


async def test_an_injected_hang_outlasts_the_client_timeout(
    core: client.CoreV1Api, double: KubeApiDouble
) -> None:
    await core.create_namespaced_pod(NS, pod("a"))
    double.inject_fault(verb="get", resource="pods", status=None, hang=300)
    with pytest.raises(asyncio.TimeoutError):
        await core.read_namespaced_pod("a", NS, _request_timeout=0.5)
    assert (await core.read_namespaced_pod("a", NS)).metadata.name == "a"


# --- running it ----------------------------------------------------------------------------


async def test_hooks_over_http_and_a_kubeconfig(kube_api: RunningDouble, tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as session:
        answer = await session.post(f"{kube_api.url}/_double/add_node", json={"name": "n1"})
        assert answer.status == 200
        unknown = await session.post(f"{kube_api.url}/_double/shutdown", json={})
        assert unknown.status == 404
    configuration = client.Configuration()
    path = write_kubeconfig(tmp_path / "kubeconfig", kube_api.url)
    await config.load_kube_config(config_file=str(path), client_configuration=configuration)
    async with ApiClient(configuration=configuration) as api:
        nodes = await client.CoreV1Api(api).list_node()
    assert [n.metadata.name for n in nodes.items] == ["n1"]


def test_a_double_in_a_thread_serves_synchronous_tests() -> None:
    with run_in_thread() as threaded:
        threaded.call(threaded.double.add_node, "n1")
        with urllib.request.urlopen(f"{threaded.url}/api/v1/nodes") as answer:
            listed = json.load(answer)
    assert [n["metadata"]["name"] for n in listed["items"]] == ["n1"]


async def test_fifteen_hundred_creates(kube_api: RunningDouble) -> None:
    count, limit = 1500, asyncio.Semaphore(32)
    async with api_client_for(kube_api.url) as api:
        core = client.CoreV1Api(api)

        async def create(index: int) -> None:
            async with limit:
                await core.create_namespaced_pod(NS, pod(f"replica-{index}"))

        started = time.perf_counter()
        await asyncio.gather(*(create(index) for index in range(count)))
        elapsed = time.perf_counter() - started
        listed = await core.list_namespaced_pod(NS)
    assert len(listed.items) == count
    print(f"\n{count} pod creates in {elapsed:.2f} s ({count / elapsed:.0f}/s)")
