"""Elastic capacity on Kubernetes, the whole platform as processes: a gang that waits for
capacity makes the autoscaler grow the cluster's pool; the executor (kubernetes backend, on the
API double) asks cluster-autoscaler with a ProvisioningRequest; the double's cluster-autoscaler
adds the nodes; the scheduler places the gang on them and its pods run; once the gang is over
and the nodes sat empty for the pool's cool-down, the autoscaler lets them go, the executor
cordons them and cluster-autoscaler removes them. Wall time (time scale 1)."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.k8s_backend import write_fleet
from cli.stack import PROJECT_ROOT, Stack
from schemas import topics
from tests.conftest import own_stack
from tests.e2e.test_kube_flows import (
    ADMIN,
    NAMESPACE,
    KubeStack,
    qm_submit,
    running,
    succeed,
    until,
    wait_state,
)
from tests.integration.kafka_tools import collect
from tests.kubeapi import ThreadedDouble, run_in_thread, write_kubeconfig
from tests.kubeapi.provisioner import REQUESTS, ClusterAutoscaler, NodeGroup

CLUSTER = "k8s-elastic"
POOL = "h100-burst"
Obj = dict[str, Any]


@dataclass
class ElasticStack:
    stack: Stack
    kube: ThreadedDouble
    workdir: Path
    autoscaler: ClusterAutoscaler

    def as_kube_stack(self) -> KubeStack:
        return KubeStack(self.stack, self.kube, self.workdir, {})

    def nodes(self) -> list[str]:
        return self.kube.call(
            lambda: sorted(n["metadata"]["name"] for n in self.kube.double.objects("nodes"))
        )

    def requests(self) -> list[Obj]:
        return self.kube.call(lambda: copy.deepcopy(self.kube.double.objects(REQUESTS, NAMESPACE)))


def _fleet(workdir: Path, kubeconfig: Path) -> Path:
    path = write_fleet(workdir, CLUSTER, kubeconfig)
    doc = yaml.safe_load(path.read_text())
    doc["clusters"][0]["node_pools"] = [
        {
            "name": POOL,
            "accelerator_type": "H100",
            "accelerators_per_node": 8,
            "cpu": 96,
            "memory_gb": 1024,
            "price_tier": "on_demand",
            "min_nodes": 0,
            "max_nodes": 2,
            "provision_s": 5,
            "cooldown_s": 5,
        }
    ]
    path.write_text(yaml.safe_dump(doc))
    return path


def _prepare(double: Any) -> ClusterAutoscaler:
    double.create("namespaces", None, {"metadata": {"name": NAMESPACE}})
    double.add_node(
        "kn-0",
        labels={"quartermaster.io/accelerator": "H100", "quartermaster.io/price-tier": "reserved"},
        allocatable={"nvidia.com/gpu": "8", "cpu": "96", "memory": "1024Gi"},
    )
    double.auto_kubelet()
    return ClusterAutoscaler(
        double,
        [
            NodeGroup(
                POOL,
                labels={"quartermaster.io/accelerator": "H100"},
                allocatable={"nvidia.com/gpu": "8", "cpu": "96", "memory": "1024Gi"},
                max_nodes=2,
            )
        ],
        provision_delay=1.5,
        scale_down_delay=0.5,
    )


@pytest.fixture(scope="module")
def elastic(
    tmp_path_factory: pytest.TempPathFactory, postgres_server_url: str
) -> Iterator[ElasticStack]:
    workdir = tmp_path_factory.mktemp("kube-elastic")
    with run_in_thread() as kube:
        autoscaler = kube.call(_prepare, kube.double)
        kubeconfig = write_kubeconfig(workdir / "kubeconfig", kube.url, NAMESPACE)
        env = {
            "QM_CAPACITY_INTERVAL_S": "1",
            "QM_DECIDE_EVERY_S": "0.5",
            "QM_UNHEALTHY_AFTER_S": "30",
        }
        with own_stack(
            workdir,
            postgres_server_url,
            env,
            fleet_file=_fleet(workdir, kubeconfig),
            policy_file=PROJECT_ROOT / "examples" / "policy.yaml",
            time_scale=1.0,
        ) as stack:
            yield ElasticStack(stack, kube, workdir, autoscaler)


@pytest.fixture(scope="module")
async def client(elastic: ElasticStack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=elastic.stack.gateway_url, timeout=30) as c:
        yield c


async def test_a_waiting_gang_grows_the_pool_through_cluster_autoscaler_and_it_shrinks_after(
    elastic: ElasticStack, client: httpx.AsyncClient
) -> None:
    ks = elastic.as_kube_stack()
    gang = await qm_submit(
        ks,
        "elastic-gang",
        {
            "replicas": 2,
            "resources": {"accelerators": 8, "accelerator_types": ["H100"]},
            "topology": {"level": "block"},
            "image": "registry.example/train:1",
        },
    )
    # The pool grows by one request, cluster-autoscaler adds the nodes, the gang runs.
    pods = await running(ks, gang, replicas=2, timeout_s=120)
    asked = elastic.kube.call(lambda: [copy.copy(a) for a in elastic.autoscaler.asked])
    assert [(a.group, a.outcome) for a in asked] == [(POOL, "provisioned")]
    added = set(asked[0].nodes)
    assert len(added) == asked[0].count <= 2
    on = {p["spec"]["nodeSelector"]["kubernetes.io/hostname"] for p in pods}
    assert on & added, (on, added)
    state = await wait_state(client, gang, {"running"})
    assert state["cluster"] == CLUSTER

    # Over: its nodes sit empty for the cool-down, are let go and removed; the static node
    # stays, and nothing more was ever asked.
    succeed(ks, pods)
    assert (await wait_state(client, gang, {"succeeded", "failed"}))["state"] == "succeeded"
    await until(
        "the pool's nodes removed",
        lambda: set(elastic.nodes()) == {"kn-0"} and added <= set(elastic.autoscaler.removed),
        timeout_s=120,
    )
    assert len(elastic.kube.call(lambda: list(elastic.autoscaler.asked))) == 1
    assert elastic.requests() == []

    # What the autoscaler decided, and the pool as operators see it.
    decisions = [
        e[1]["payload"]
        for e in await collect(
            elastic.stack.server("kafka").url,
            (topics.AUTOSCALE_DECIDED,),
            lambda _t, e: e["payload"]["pool"] == POOL,
            count=10_000,
            timeout_s=3,
        )
    ]
    assert any(gang in d["for_jobs"] for d in decisions)
    assert sorted({n for d in decisions for n in d["remove"]}) == sorted(added)
    r = await client.get("/v1/pools", headers=ADMIN)
    assert r.status_code == 200, r.text
    (pool,) = [p for p in r.json()["pools"] if p["pool"] == POOL]
    assert pool["desired_nodes"] == 0, pool
