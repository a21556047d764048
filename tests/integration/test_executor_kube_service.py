"""The executor service with QM_EXECUTOR_BACKEND=kubernetes, on the real broker and PostgreSQL,
driving the Kubernetes API double through a kubeconfig: a gang placed on the log becomes pods,
starts, succeeds, and the cluster's Node objects are its inventory."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from schemas import topics
from schemas.envelope import Envelope
from services.common.topics import ensure_topics
from services.executor.app import create_app
from services.executor.settings import ExecutorSettings
from tests.conftest import private_kafka
from tests.integration.conftest import running
from tests.integration.kafka_tools import collect, produce
from tests.integration.kube_rig import NAMESPACE, add_gpu_node, create_namespace, placement
from tests.kubeapi import RunningDouble, write_kubeconfig
from tests.kubeapi.fixtures import kube_api  # noqa: F401

# A cluster of the example fleet no other executor test uses (one store schema per cluster).
CLUSTER = "tpu-slices"
EPOCH = 1000


@pytest.fixture
async def own_kafka(tmp_path: Path) -> AsyncIterator[str]:
    """A broker of its own: the placement's leader epoch (above every other test's) would
    otherwise fence the other tests' schedulers, as the preemptor does for epochs it reads."""
    with private_kafka(tmp_path / "kafka") as url:
        await ensure_topics(url)
        yield url


async def test_a_gang_runs_on_the_cluster_through_the_log(
    service_env: dict[str, Any],
    kube_api: RunningDouble,  # noqa: F811
    own_kafka: str,
    tmp_path: Path,
) -> None:
    double = kube_api.double
    create_namespace(double)
    add_gpu_node(double, "k-0")
    add_gpu_node(double, "k-1")
    double.auto_kubelet()
    settings = ExecutorSettings(
        **{**service_env, "kafka_bootstrap": own_kafka},
        executor_cluster=CLUSTER,
        time_scale=1.0,
        executor_backend="kubernetes",
        kube_config=write_kubeconfig(tmp_path / "kubeconfig", kube_api.url),
        kube_namespace=NAMESPACE,
        heartbeat_interval_s=0.2,
        capacity_interval_s=0.2,
    )
    bootstrap = own_kafka
    job_id = f"kube-{uuid.uuid4().hex[:8]}"
    p = placement(job_id, ["k-0", "k-1"], gpus=8, epoch=EPOCH)
    p = p.model_copy(update={"cluster": CLUSTER})
    env = Envelope(type="PlacementDecided", payload=p.model_dump(mode="json"))

    def mine(_topic: str, e: dict[str, Any]) -> bool:
        return job_id in json.dumps(e["payload"])

    def inventory(_topic: str, e: dict[str, Any]) -> bool:
        return bool(e["payload"].get("cluster") == CLUSTER)

    # Bounded: once, inside the whole suite, this test waited without end (not reproduced
    # alone); a timeout fails it with the line it was waiting on instead of stalling the run.
    async with asyncio.timeout(240), running(create_app(settings)):
        (capacity,) = await collect(bootstrap, (topics.CLUSTER_CAPACITY,), inventory, count=1)
        assert [n["node_id"] for n in capacity[1]["payload"]["nodes"]] == ["k-0", "k-1"]
        await produce(
            bootstrap, topics.PLACEMENT_DECIDED, [(job_id, env.model_dump_json().encode())]
        )
        started = await collect(bootstrap, (topics.JOB_STARTED,), mine, count=1)
        assert started[0][1]["payload"]["nodes"] == ["k-0", "k-1"]
        pods = [
            o["metadata"]["name"]
            for o in double.objects("pods", NAMESPACE)
            if o["metadata"]["annotations"].get("quartermaster.io/job") == job_id
        ]
        assert len(pods) == 2
        for name in pods:
            double.pod_succeeded(NAMESPACE, name)
        ended = await collect(bootstrap, (topics.JOB_STARTED, topics.JOB_FINISHED), mine, count=2)
        finished = [e["payload"] for t, e in ended if t == topics.JOB_FINISHED]
        assert finished[0]["outcome"] == "succeeded"
