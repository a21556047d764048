"""Readable builders for core tests: fleets, jobs and snapshots in one line each."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from core.model import (
    AcceleratorModel,
    Allocation,
    Cluster,
    ClusterId,
    ClusterKind,
    JobId,
    JobRequest,
    Node,
    NodeId,
    PriceTier,
    ReplicaPlacement,
    Snapshot,
    TenantId,
    TopologyLevel,
    WorkloadKind,
)

MODELS = {
    "H100": AcceleratorModel("H100", "hopper", 80.0, 3.0),
    "A100": AcceleratorModel("A100", "ampere", 40.0, 1.5),
    "L4": AcceleratorModel("L4", "ada", 24.0, 0.5),
}


def gpu_nodes(
    count: int,
    gpus: int = 8,
    type: str = "H100",
    cluster: str = "c1",
    prefix: str = "n",
    nodes_per_rack: int = 4,
    racks_per_block: int = 4,
    nvlink_size: int = 1,
    tier: PriceTier = PriceTier.ON_DEMAND,
    cpu: float = 64.0,
    memory_gb: float = 512.0,
) -> dict[NodeId, Node]:
    nodes: dict[NodeId, Node] = {}
    for i in range(count):
        rack = i // nodes_per_rack
        node_id = NodeId(f"{cluster}-{prefix}-{i:04d}")
        nodes[node_id] = Node(
            node_id=node_id,
            cluster=ClusterId(cluster),
            block=f"b{rack // racks_per_block}",
            rack=f"r{rack}",
            nvlink_domain=f"{prefix}-nv{i // nvlink_size}",
            accelerator=MODELS.get(type, AcceleratorModel(type, "x", 16.0)),
            accelerators=gpus,
            cpu=cpu,
            memory_gb=memory_gb,
            price_tier=tier,
        )
    return nodes


def cluster(name: str = "c1", prices: Mapping[str, float] | None = None) -> Cluster:
    table = {(t, PriceTier.ON_DEMAND): p for t, p in (prices or {}).items()}
    return Cluster(ClusterId(name), "here", ClusterKind.ON_PREM, table)


_counter = iter(range(1_000_000))


def job(
    gpus: float = 1,
    *,
    replicas: int = 1,
    job_id: str | None = None,
    tenant: str = "vision",
    priority: str = "normal",
    types: tuple[str, ...] = (),
    topology: TopologyLevel = TopologyLevel.CLUSTER,
    required: bool = False,
    preemptible: bool = True,
    submit: float = 0.0,
    kind: WorkloadKind = WorkloadKind.TRAINING,
    cpu: float = 1.0,
    memory_gb: float = 4.0,
    excluded: Iterable[str] = (),
    max_runtime_s: float | None = None,
) -> JobRequest:
    return JobRequest(
        job_id=JobId(job_id or f"j{next(_counter):06d}"),
        tenant=TenantId(tenant),
        project="p",
        user="u",
        queue="default",
        priority_class=priority,
        kind=kind,
        replicas=replicas,
        accelerators=gpus,
        accelerator_types=types,
        accelerator_memory_gb=None,
        cpu=cpu,
        memory_gb=memory_gb,
        topology=topology,
        topology_required=required,
        preemptible=preemptible,
        submit_time=submit,
        max_runtime_s=max_runtime_s,
        excluded_nodes=frozenset(NodeId(n) for n in excluded),
    )


def gang(replicas: int, gpus: float = 8, **kwargs: object) -> JobRequest:
    return job(gpus, replicas=replicas, **kwargs)  # type: ignore[arg-type]


def running(j: JobRequest, *node_ids: str, start: float = 0.0) -> Allocation:
    """An allocation of `j` with one replica on each given node."""
    replicas = tuple(
        ReplicaPlacement(i, NodeId(n), j.accelerators, j.cpu, j.memory_gb)
        for i, n in enumerate(node_ids)
    )
    return Allocation(j, ClusterId(node_ids[0].split("-")[0]), replicas, start)


def snapshot(
    nodes: Mapping[NodeId, Node],
    pending: Iterable[JobRequest] = (),
    running_jobs: Iterable[Allocation] = (),
    clusters: Iterable[Cluster] = (),
    usage: Mapping[str, float] | None = None,
) -> Snapshot:
    cl = {c.cluster_id: c for c in clusters}
    for n in nodes.values():
        cl.setdefault(n.cluster, cluster(n.cluster))
    return Snapshot(
        clusters=cl,
        nodes=dict(nodes),
        running={a.job.job_id: a for a in running_jobs},
        pending=list(pending),
        usage={TenantId(k): v for k, v in (usage or {}).items()},
    )
