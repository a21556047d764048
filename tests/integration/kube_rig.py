"""A rig for the executor's kubernetes backend: the real Executor (its decisions), the
KubeBackend and KubeInventory, against the Kubernetes API double over HTTP with the real
kubernetes-asyncio client. The store and outbox are kept in memory (the PostgreSQL side is
covered by test_executor_service.py); events land in `rig.sent`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from aiokafka import ConsumerRecord
from kubernetes_asyncio.client import ApiClient
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from core.model import AcceleratorModel
from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobCheckpointRequested,
    JobPreemptOrdered,
    JobStopOrdered,
    PlacementDecided,
    ReplicaAssignment,
)
from schemas.health import NodeProbe, NodeRecovered, NodeUnhealthy
from schemas.job import JobSpec
from services.common.kafka import OutMessage
from services.executor.handlers import Executor
from services.executor.kube.backend import KubeBackend, KubeOptions
from services.executor.kube.inventory import KubeInventory
from services.executor.kube.names import GangNames
from services.executor.kube.nodes import NodeLabels
from services.executor.kube.pods import PodOptions
from services.executor.metrics import ExecutorMetrics
from services.executor.nodes import NodeBook
from services.executor.store import RunKey, RunningJob
from tests.kubeapi import KubeApiDouble, RunningDouble, api_client_for

CLUSTER = "kube-test"
NAMESPACE = "quartermaster-jobs"
ACCELERATOR_LABEL = "quartermaster.io/accelerator"
TYPES = {"H100": AcceleratorModel("H100", "hopper", 80, 3.0)}
TIMEOUT_S = 30.0


class MemoryStore:
    """The executor's store, in memory: enough to restart an executor from it. It keeps
    copies, as a database would; `fail_writes` makes the next writes fail."""

    def __init__(self) -> None:
        self.runs: dict[str, RunningJob] = {}
        self.epoch = 0
        self.tombstones: dict[str, float] = {}
        self.fail_writes = 0

    async def load(self) -> tuple[list[RunningJob], int, dict[str, float]]:
        runs = [dataclasses.replace(j) for j in self.runs.values()]
        return runs, self.epoch, dict(self.tombstones)

    async def write(
        self,
        conn: Any,
        *,
        started: list[RunningJob],
        ended: list[RunKey],
        epoch: int | None,
        tombstones: list[str],
        checkpointed: Any = (),
        announced: Any = (),
    ) -> None:
        if self.fail_writes:
            self.fail_writes -= 1
            raise ConnectionError("the store is unreachable (injected)")
        for job in started:
            self.runs[job.job_id] = dataclasses.replace(job)
        for job in announced:
            if job.job_id in self.runs and self.runs[job.job_id].attempt == job.attempt:
                self.runs[job.job_id].started = True
        for job_id, attempt in ended:
            if job_id in self.runs and self.runs[job_id].attempt == attempt:
                del self.runs[job_id]
        if epoch is not None:
            self.epoch = max(self.epoch, epoch)
        for t in tombstones:
            self.tombstones[t] = datetime.now(UTC).timestamp()

    async def forget_tombstones(self, before: datetime) -> int:
        return 0


@dataclass
class MemoryTx:
    conn: Any = None
    out: list[OutMessage] = field(default_factory=list)

    async def claim(self, event_ids: list[str]) -> set[str]:
        return set(event_ids)

    def emit(self, messages: Any) -> None:
        self.out.extend(messages)


class MemoryRelay:
    def __init__(self) -> None:
        self.sent: list[OutMessage] = []

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[MemoryTx]:
        tx = MemoryTx()
        yield tx
        self.sent.extend(tx.out)


_offsets = itertools.count()


def record(topic: str, event_type: str, payload: BaseModel) -> ConsumerRecord[Any, Any]:
    env = Envelope(type=event_type, payload=payload.model_dump(mode="json"))
    value = env.model_dump_json().encode()
    return ConsumerRecord(topic, 0, next(_offsets), 0, 0, None, value, None, 0, len(value), ())


def placement(
    job_id: str,
    nodes: list[str],
    *,
    gpus: float = 1,
    attempt: int = 1,
    epoch: int = 1,
    **spec: Any,
) -> PlacementDecided:
    fields = {"tenant": "vision", "job_id": job_id, "image": "trainer:1", "replicas": len(nodes)}
    return PlacementDecided(
        job_id=job_id,
        attempt=attempt,
        epoch=epoch,
        leader="test",
        cluster=CLUSTER,
        accelerator_type="H100",
        spec=JobSpec.model_validate({**fields, **spec}),
        replicas=[
            ReplicaAssignment(replica=i, node_id=n, accelerators=gpus, cpu=2, memory_gb=8)
            for i, n in enumerate(nodes)
        ],
    )


def add_gpu_node(double: KubeApiDouble, name: str, gpus: int = 8) -> None:
    double.add_node(
        name,
        labels={ACCELERATOR_LABEL: "H100", "kubernetes.io/hostname": f"host-{name}"},
        allocatable={"nvidia.com/gpu": str(gpus), "cpu": "64", "memory": "512Gi"},
        taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}],
    )


class Rig:
    def __init__(
        self,
        kube: RunningDouble,
        store: MemoryStore | None = None,
        unschedulable_after_s: float = 3600.0,
    ) -> None:
        self.kube = kube
        self.double = kube.double
        self.store = store or MemoryStore()
        self.relay = MemoryRelay()
        self.probes: list[NodeProbe] = []
        self.unschedulable_after_s = unschedulable_after_s
        self.api: ApiClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> Rig:
        self.api = api_client_for(self.kube.url)
        self.book = NodeBook({})
        labels = NodeLabels(quarantine_taint="quartermaster.io/quarantined")
        self.inventory = KubeInventory(
            self.api, CLUSTER, labels, TYPES, self.book, on_probe=self._probe
        )
        await self.inventory.load()
        options = KubeOptions(
            PodOptions(namespace=NAMESPACE, cluster=CLUSTER),
            unschedulable_after_s=self.unschedulable_after_s,
            retry_for_s=5.0,
            quarantine_taint="quartermaster.io/quarantined",
        )
        self.backend = KubeBackend(self.api, options, hostnames=self.inventory.hostname)
        self.executor = Executor(
            CLUSTER,
            self.book,
            self.store,  # type: ignore[arg-type]
            self.relay,  # type: ignore[arg-type]
            ExecutorMetrics(CollectorRegistry()),
            time_scale=1.0,
            default_duration_s=300.0,
            backend=self.backend,
        )
        await self.executor.restore()
        self.backend.adopt(list(self.executor.running.values()))
        self._tasks = [
            asyncio.create_task(self.backend.run(self.executor.report)),
            asyncio.create_task(self.inventory.run()),
        ]
        await self.wait(self.backend.watch.listed.is_set, "the first list of pods")
        return self

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.api is not None:
            await self.api.close()

    async def _probe(self, probe: NodeProbe) -> None:
        self.probes.append(probe)

    # --- input ---

    async def send(self, topic: str, event_type: str, payload: BaseModel) -> None:
        await self.executor.process((record(topic, event_type, payload),))

    async def place(self, p: PlacementDecided) -> None:
        await self.send(topics.PLACEMENT_DECIDED, "PlacementDecided", p)

    async def cancel(self, job_id: str) -> None:
        await self.send(topics.JOB_STOP_ORDERED, "JobStopOrdered", JobStopOrdered(job_id=job_id))

    async def preempt(self, job_id: str, attempt: int = 1) -> None:
        order = JobPreemptOrdered(
            job_id=job_id,
            attempt=attempt,
            cluster=CLUSTER,
            for_job="vip",
            reason_code="priority",
            message="room for vip",
        )
        await self.send(topics.JOB_PREEMPT_ORDERED, "JobPreemptOrdered", order)

    async def checkpoint(self, job_id: str, attempt: int = 1, grace_s: float = 30) -> None:
        now = datetime.now(UTC)
        order = JobCheckpointRequested(
            job_id=job_id,
            attempt=attempt,
            cluster=CLUSTER,
            grace_s=grace_s,
            stop_at=now + timedelta(seconds=grace_s),
            for_job="vip",
            reason_code="priority",
        )
        await self.send(topics.JOB_CHECKPOINT_REQUESTED, "JobCheckpointRequested", order)

    async def node_unhealthy(self, node: str, cause: str = "xid_79") -> None:
        down = NodeUnhealthy(
            node_id=node,
            cluster=CLUSTER,
            cause=cause,
            signals=["gpu_xid 79"],
            since=datetime.now(UTC),
            incident_id="inc-1",
        )
        await self.send(topics.NODE_UNHEALTHY, "NodeUnhealthy", down)

    async def node_recovered(self, node: str, cause: str = "xid_79") -> None:
        back = NodeRecovered(
            node_id=node,
            cluster=CLUSTER,
            cause=cause,
            unhealthy_since=datetime.now(UTC) - timedelta(minutes=30),
            recovered_at=datetime.now(UTC),
            incident_id="inc-1",
            signals_seen=1,
        )
        await self.send(topics.NODE_RECOVERED, "NodeRecovered", back)

    # --- output ---

    def events(self, event_type: str | None = None, job_id: str | None = None) -> list[Envelope]:
        return [
            m.envelope
            for m in self.relay.sent
            if (event_type is None or m.envelope.type == event_type)
            and (job_id is None or m.envelope.payload.get("job_id") == job_id)
        ]

    def pods(self, job_id: str, attempt: int = 1) -> list[dict[str, Any]]:
        service = GangNames(job_id, attempt).service
        return [
            p
            for p in self.double.objects("pods", NAMESPACE)
            if p["metadata"]["name"].startswith(service + "-")
        ]

    def pod_names(self, job_id: str, replicas: int, attempt: int = 1) -> list[str]:
        gang = GangNames(job_id, attempt)
        return [gang.pod(i) for i in range(replicas)]

    async def wait(
        self, condition: Callable[[], Any], what: str, within_s: float = TIMEOUT_S
    ) -> Any:
        """Poll `condition` until it is truthy (its value), or fail saying what never came."""
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            value = condition()
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.02)

    async def wait_event(self, event_type: str, job_id: str) -> Envelope:
        found = await self.wait(lambda: self.events(event_type, job_id), f"{event_type} {job_id}")
        return found[0]  # type: ignore[no-any-return]


def create_namespace(double: KubeApiDouble) -> None:
    double.create("namespaces", None, {"metadata": {"name": NAMESPACE}})


@contextlib.asynccontextmanager
async def rig(kube: RunningDouble, **options: Any) -> AsyncIterator[Rig]:
    running = await Rig(kube, **options).start()
    try:
        yield running
    finally:
        await running.stop()


def gang_pods(double: KubeApiDouble, job_id: str, replicas: int) -> Iterator[str]:
    gang = GangNames(job_id, 1)
    return (gang.pod(i) for i in range(replicas))


ROLE = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base" / "rbac-executor.yaml"


def granted() -> set[tuple[str, str]]:
    """(verb, resource) pairs deploy/k8s grants the executor's service account."""
    pairs = set()
    for doc in yaml.safe_load_all(ROLE.read_text()):
        for rule in (doc or {}).get("rules") or []:
            for resource in rule["resources"]:
                for group in rule["apiGroups"]:
                    name = f"{resource}.{group}" if group else resource
                    pairs |= {(verb, name) for verb in rule["verbs"]}
    return pairs
