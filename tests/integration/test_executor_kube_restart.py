"""The kubernetes backend across a restart and a broken watch, against the Kubernetes API
double: a restarted executor adopts its gangs by their labels, reports what ended while it was
away, hands back runs whose pods are gone and deletes pods of no run it holds; the pod watch
lists again after 410 Gone and resumes after a cut stream without losing an event."""

from __future__ import annotations

from datetime import UTC, datetime

from services.executor.backend import NEVER
from services.executor.kube import names
from services.executor.simulated import RunEnd
from services.executor.store import RunningJob
from tests.integration.kube_rig import (
    NAMESPACE,
    MemoryStore,
    add_gpu_node,
    create_namespace,
    placement,
    rig,
)
from tests.kubeapi import RunningDouble
from tests.kubeapi.fixtures import kube_api  # noqa: F401


async def test_a_restarted_executor_adopts_reports_and_cleans_up(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    for n in ("gpu-0", "gpu-1", "gpu-2"):
        add_gpu_node(double, n)
    store = MemoryStore()
    async with rig(kube_api, store=store) as before:
        for job_id, node in (("done", "gpu-0"), ("alive", "gpu-1"), ("stale", "gpu-2")):
            await before.place(placement(job_id, [node], gpus=2))
            (name,) = await before.wait(
                lambda j=job_id: [  # type: ignore[misc]
                    p["metadata"]["name"]
                    for p in before.pods(j)
                    if not p["spec"].get("schedulingGates")
                ],
                f"{job_id} ungated",
            )
            double.pod_running(NAMESPACE, name, node=node)
            await before.wait_event("JobStarted", job_id)
    # While the executor is away: one gang ends, one run is forgotten by the store (as if its
    # placement had been refused), and the store holds a run whose pods never came.
    double.pod_succeeded(NAMESPACE, before.pods("done")[0]["metadata"]["name"])
    del store.runs["stale"]
    now = datetime.now(UTC)
    ghost = placement("ghost", ["gpu-2"], gpus=1)
    store.runs["ghost"] = RunningJob(
        job_id="ghost",
        attempt=1,
        epoch=1,
        tenant="vision",
        replicas=ghost.replicas,
        started_at=now,
        ends_at=now + NEVER,
        end=RunEnd.SUCCEEDED,
        started=False,
    )
    async with rig(kube_api, store=store) as after:
        finished = await after.wait_event("JobFinished", "done")
        assert finished.payload["outcome"] == "succeeded"
        lost = await after.wait_event("JobPreempted", "ghost")
        assert lost.payload["reason_code"] == "pods_lost"
        await after.wait(lambda: not after.pods("stale"), "the stale run's pod deleted")
        assert after.events("JobStarted") == []  # "alive" was announced before the restart
        assert set(after.executor.running) == {"alive"}
        assert set(after.book.by_job) == {"alive"}
        double.pod_succeeded(NAMESPACE, after.pods("alive")[0]["metadata"]["name"])
        finished = await after.wait_event("JobFinished", "alive")
        assert finished.payload["outcome"] == "succeeded"
        await after.wait(lambda: not after.pods("done"), "the ended gang's pod deleted")


async def test_a_gang_gated_when_the_executor_stopped_is_ungated_after_restart(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    store = MemoryStore()
    async with rig(kube_api, store=store) as before:
        await before.place(placement("half", ["gpu-0"], gpus=2))
        (name,) = await before.wait(
            lambda: [
                p["metadata"]["name"]
                for p in before.pods("half")
                if not p["spec"].get("schedulingGates")
            ],
            "the pod ungated",
        )
    # As if the executor had died between creating the gang and lifting its gate.
    gate = [{"name": names.GATE}]
    double.mutate("pods", NAMESPACE, name, lambda pod: pod["spec"].update(schedulingGates=gate))
    assert store.runs["half"].started is False
    async with rig(kube_api, store=store) as after:
        await after.wait(
            lambda: not double.get("pods", NAMESPACE, name)["spec"].get("schedulingGates"),
            "the gate lifted",
        )
        double.pod_running(NAMESPACE, name, node="gpu-0")
        started = await after.wait_event("JobStarted", "half")
        assert started.payload["nodes"] == ["gpu-0"]


async def test_the_pod_watch_lists_again_after_410_gone(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    add_gpu_node(double, "gpu-1")
    async with rig(kube_api) as r:
        await r.place(placement("relist", ["gpu-0", "gpu-1"], gpus=8))
        pods = await r.wait(
            lambda: (
                r.pod_names("relist", 2)
                if len(r.pods("relist")) == 2
                and not any(p["spec"].get("schedulingGates") for p in r.pods("relist"))
                else None
            ),
            "the gang ungated",
        )
        await r.wait(lambda: len(r.backend.gangs[("relist", 1)].pods) == 2, "pods seen")
        lists = r.backend.watch.lists
        # In one step, with no chance for the backend to run in between: the watch ends, the
        # pods move on, history is compacted. Resuming from its version gets 410 Gone.
        double.drop_watches("pods")
        double.pod_running(NAMESPACE, pods[0], node="gpu-0")
        double.create("configmaps", NAMESPACE, {"metadata": {"name": "bump"}})
        double.compact()
        await r.wait(lambda: r.backend.watch.lists > lists, "a new list")
        double.pod_running(NAMESPACE, pods[1], node="gpu-1")
        started = await r.wait_event("JobStarted", "relist")
        assert started.payload["nodes"] == ["gpu-0", "gpu-1"]


async def test_the_pod_watch_resumes_after_a_cut_stream(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    add_gpu_node(double, "gpu-1")
    async with rig(kube_api) as r:
        await r.place(placement("cut", ["gpu-0", "gpu-1"], gpus=8))
        pods = await r.wait(
            lambda: (
                r.pod_names("cut", 2)
                if len(r.pods("cut")) == 2
                and not any(p["spec"].get("schedulingGates") for p in r.pods("cut"))
                else None
            ),
            "the gang ungated",
        )
        await r.wait(lambda: len(r.backend.gangs[("cut", 1)].pods) == 2, "pods seen")
        lists = r.backend.watch.lists
        double.drop_watches("pods", abrupt=True)
        double.pod_running(NAMESPACE, pods[0], node="gpu-0")
        double.pod_running(NAMESPACE, pods[1], node="gpu-1")
        started = await r.wait_event("JobStarted", "cut")
        assert started.payload["nodes"] == ["gpu-0", "gpu-1"]
        assert r.backend.watch.lists == lists  # watched again from its version, not listed again


async def test_a_report_the_executor_could_not_take_is_made_again(
    kube_api: RunningDouble,  # noqa: F811
) -> None:
    """The store fails as the gang is announced: the executor rebuilds its memory from the
    store, and the backend, having no word that the report was taken, lists and reports again."""
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "gpu-0")
    store = MemoryStore()
    async with rig(kube_api, store=store) as r:
        await r.place(placement("retry", ["gpu-0"], gpus=2))
        (name,) = await r.wait(
            lambda: [
                p["metadata"]["name"]
                for p in r.pods("retry")
                if not p["spec"].get("schedulingGates")
            ],
            "the pod ungated",
        )
        lists = r.backend.watch.lists
        store.fail_writes = 1
        double.pod_running(NAMESPACE, name, node="gpu-0")
        started = await r.wait_event("JobStarted", "retry")
        assert started.payload["nodes"] == ["gpu-0"]
        assert r.backend.watch.lists > lists and store.fail_writes == 0
        assert store.runs["retry"].started is True
