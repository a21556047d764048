"""Elastic pools on Kubernetes: the executor service (QM_EXECUTOR_BACKEND=kubernetes, real
broker and PostgreSQL) carries out `autoscale.decided` as ProvisioningRequests on the API
double, whose cluster-autoscaler (tests/kubeapi/provisioner.py) adds the nodes, reports
stockouts and takes released empty nodes away. A decision read again, or an executor restarted,
asks nothing twice."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from aiokafka import AIOKafkaConsumer

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import AutoscaleDecided
from services.executor.app import create_app
from services.executor.settings import ExecutorSettings
from tests.integration.conftest import ROOT, running
from tests.integration.kafka_tools import produce
from tests.integration.kube_rig import ACCELERATOR_LABEL, NAMESPACE, create_namespace, granted
from tests.kubeapi import RunningDouble, write_kubeconfig
from tests.kubeapi.fixtures import kube_api  # noqa: F401
from tests.kubeapi.provisioner import REQUESTS, ClusterAutoscaler, NodeGroup

POOL = "h100-elastic"
KEEP = "cluster-autoscaler.kubernetes.io/scale-down-disabled"


def fleet_with_a_kube_pool(path: Path, cluster: str) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "fleet.yaml").read_text())
    doc["clusters"].append(
        {
            "name": cluster,
            "location": "us-east-2",
            "kind": "cloud",
            "prices": {"H100": {"on_demand": 4.5}},
            "node_groups": [],
            "node_pools": [
                {
                    "name": POOL,
                    "accelerator_type": "H100",
                    "accelerators_per_node": 8,
                    "cpu": 64,
                    "memory_gb": 512,
                    "min_nodes": 0,
                    "max_nodes": 4,
                    "provision_s": 60,
                    "cooldown_s": 60,
                }
            ],
        }
    )
    path.write_text(yaml.safe_dump(doc))
    return path


class Inventory:
    """The cluster's cluster.capacity events, read forward from the start of the topic."""

    def __init__(self, bootstrap: str, cluster: str) -> None:
        self.bootstrap = bootstrap
        self.cluster = cluster
        self.consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> Inventory:
        self.consumer = AIOKafkaConsumer(
            topics.CLUSTER_CAPACITY,
            bootstrap_servers=self.bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            fetch_max_wait_ms=100,
        )
        await self.consumer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.consumer is not None:
            await self.consumer.stop()

    async def until(self, want: Callable[[dict[str, Any]], bool], timeout_s: float = 60) -> Any:
        """The next inventory of the cluster `want` accepts (its payload)."""
        assert self.consumer is not None
        async with asyncio.timeout(timeout_s):
            while True:
                batches = await self.consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for r in records:
                        env = Envelope.model_validate_json(r.value)
                        if env.payload.get("cluster") == self.cluster and want(env.payload):
                            return env.payload


def marked(double: Any, name: str) -> bool:
    node = double.find("nodes", None, name)
    annotations = (node or {}).get("metadata", {}).get("annotations") or {}
    return bool(
        annotations.get(KEEP) == "true" and annotations.get("quartermaster.io/provisioned-by")
    )


def pool(cap: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in cap["pools"] if p["pool"] == POOL)


def ready(cap: dict[str, Any]) -> list[str]:
    return [n["node_id"] for n in pool(cap)["nodes"] if n["state"] == "ready"]


async def decide(bootstrap: str, cluster: str, size: int, remove: list[str] = ()) -> None:  # type: ignore[assignment]
    d = AutoscaleDecided(
        cluster=cluster,
        pool=POOL,
        desired_nodes=size,
        remove=list(remove),
        reason="test",
        inventory_at=datetime.now(UTC),
    )
    env = Envelope(type="AutoscaleDecided", payload=d.model_dump(mode="json"))
    await produce(bootstrap, topics.AUTOSCALE_DECIDED, [(POOL, env.model_dump_json().encode())])


async def test_a_pool_grows_by_provisioning_request_and_shrinks_by_releasing_empty_nodes(
    service_env: dict[str, Any],
    kube_api: RunningDouble,  # noqa: F811
    tmp_path: Path,
) -> None:
    double = kube_api.double
    create_namespace(double)
    out_of_stock: set[str] = set()
    autoscaler = ClusterAutoscaler(
        double,
        [
            NodeGroup(
                POOL,
                labels={ACCELERATOR_LABEL: "H100"},
                allocatable={"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi"},
            )
        ],
        provision_delay=1.2,  # past a second: creation times are the API's, to the second
        scale_down_delay=0.2,
        stockout=lambda group: group in out_of_stock,
    )
    cluster = f"kube-pools-{uuid.uuid4().hex[:6]}"
    settings = ExecutorSettings(
        **{**service_env, "fleet_file": fleet_with_a_kube_pool(tmp_path / "fleet.yaml", cluster)},
        executor_cluster=cluster,
        time_scale=1.0,
        executor_backend="kubernetes",
        kube_config=write_kubeconfig(tmp_path / "kubeconfig", kube_api.url),
        kube_namespace=NAMESPACE,
        heartbeat_interval_s=0.2,
        capacity_interval_s=0.2,
    )
    bootstrap = str(service_env["kafka_bootstrap"])

    def requests() -> list[dict[str, Any]]:
        return double.objects(REQUESTS, NAMESPACE)

    async with asyncio.timeout(240), Inventory(bootstrap, cluster) as inventory:
        async with running(create_app(settings)):
            await inventory.until(lambda c: pool(c)["desired_nodes"] == 0)
            await decide(bootstrap, cluster, 2)
            # One request for both nodes while they come; the decision read again (a new
            # envelope of the same size) asks nothing more.
            await inventory.until(lambda c: len(pool(c)["nodes"]) == 2)
            await decide(bootstrap, cluster, 2)
            cap = await inventory.until(lambda c: len(ready(c)) == 2)
            assert [(a.group, a.count, a.outcome) for a in autoscaler.asked] == [
                (POOL, 2, "provisioned")
            ]
            nodes = sorted(autoscaler.asked[0].nodes)
            assert sorted(ready(cap)) == nodes
            # The scheduler sees them as nodes of the cluster; the met request and its
            # template are gone; each node is kept from scale-down and marked with its request.
            await inventory.until(
                lambda c: set(nodes) <= {n["node_id"] for n in c["nodes"]} and not requests()
            )
            assert not double.objects("podtemplates", NAMESPACE)
            spec = autoscaler.asked[0].template
            assert spec["nodeSelector"] == {"quartermaster.io/pool": POOL}
            assert spec["containers"][0]["resources"]["requests"] == {"nvidia.com/gpu": "8"}
            for name in nodes:
                await inventory.until(lambda _c, n=name: marked(double, n))
            # A third node while the zone is out of stock: cluster-autoscaler keeps trying; the
            # executor stops (a crash, a rollout) while the request is open.
            out_of_stock.add(POOL)
            await decide(bootstrap, cluster, 3)
            await inventory.until(lambda c: len(pool(c)["nodes"]) == 3 and len(ready(c)) == 2)
            await inventory.until(lambda _c: autoscaler.asked[-1].outcome == "waiting")
            assert [a.outcome for a in autoscaler.asked] == ["provisioned", "waiting"]
            # Its placeholders may not land on a node the pool has (else "capacity is found").
            (term,) = autoscaler.asked[1].template["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]["nodeSelectorTerms"]
            assert term["matchFields"][0]["values"] == nodes

        # Restarted: the open request is found and counted, nothing is asked again; when the
        # stock comes back its node joins.
        async with running(create_app(settings)):
            cap = await inventory.until(lambda c: len(pool(c)["nodes"]) == 3)
            assert pool(cap)["desired_nodes"] == 3 and len(autoscaler.asked) == 2
            out_of_stock.clear()
            cap = await inventory.until(lambda c: len(ready(c)) == 3)
            assert len(autoscaler.asked) == 2
            third = autoscaler.asked[1].nodes[0]

            # The autoscaler lets one empty node go: cordoned, unprotected, then taken away.
            await decide(bootstrap, cluster, 2, remove=[nodes[0]])
            cap = await inventory.until(
                lambda c: (
                    sorted(ready(c)) == sorted([nodes[1], third])
                    and nodes[0] not in {n["node_id"] for n in c["nodes"]}
                )
            )
            assert pool(cap)["desired_nodes"] == 2
            await inventory.until(lambda _c: autoscaler.removed == [nodes[0]])

        # A stockout that outlasts the pool's timeout (3 s here): the request is deleted, the
        # pool says why and drops back to what it has, and asks nothing more.
        quick = settings.model_copy(update={"kube_provisioning_timeout_s": 3.0})
        async with running(create_app(quick)):
            out_of_stock.add(POOL)
            await decide(bootstrap, cluster, 3)
            await inventory.until(lambda _c: autoscaler.asked[-1].outcome == "waiting")
            cap = await inventory.until(lambda c: "stockout" in (pool(c).get("failing") or ""))
            assert "not provisioned within" in pool(cap)["failing"]
            assert pool(cap)["desired_nodes"] == 2
            for _ in range(10):
                cap = await inventory.until(lambda _c: True)
            assert [a.outcome for a in autoscaler.asked] == ["provisioned"] * 2 + ["waiting"]
            assert not requests() and not double.objects("podtemplates", NAMESPACE)
            assert sorted(ready(cap)) == sorted([nodes[1], third])

    # Everything it asked of the API is within what deploy/k8s grants the executor.
    asked = {(q.verb, q.resource.split("/")[0]) for q in double.requests}
    assert asked - granted() == set()
