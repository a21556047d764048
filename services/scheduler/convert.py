"""The one place where wire models become the core's dataclasses, and decisions become events."""

from __future__ import annotations

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
    TenantId,
    TopologyLevel,
    WorkloadKind,
)
from schemas.events import (
    ClusterCapacity,
    JobQueued,
    PlacementDecided,
    PlacementHead,
    ReplicaAssignment,
)
from schemas.job import WorkloadKind as JobKind
from schemas.serving import SERVICE_LABEL


def job_request(event: JobQueued, time_scale: float = 1.0) -> JobRequest:
    """The core's view of a queued job; times are fleet time (wall x `time_scale`)."""
    spec = event.spec
    res = spec.resources
    return JobRequest(
        job_id=JobId(event.job_id),
        tenant=TenantId(spec.tenant),
        project=spec.project,
        user=spec.user,
        queue=spec.queue,
        priority_class=spec.priority_class,
        kind=WorkloadKind(spec.kind.value),
        replicas=spec.replicas,
        accelerators=res.accelerators,
        accelerator_types=tuple(res.accelerator_types),
        accelerator_memory_gb=res.accelerator_memory_gb,
        cpu=res.cpu,
        memory_gb=res.memory_gb,
        topology=TopologyLevel(spec.topology.level.value),
        topology_required=spec.topology.required,
        preemptible=spec.preemptible,
        submit_time=event.submitted_at.timestamp() * time_scale,
        queued_time=None if event.queued_at is None else event.queued_at.timestamp() * time_scale,
        max_runtime_s=spec.max_runtime_s,
        excluded_nodes=frozenset(NodeId(n) for n in event.excluded_nodes),
        # The replicas of one inference service are kept apart (docs/serving.md).
        spread_group=_spread_group(event),
    )


def _spread_group(event: JobQueued) -> str | None:
    """A service replica's group: its tenant's service (a label alone could name another
    tenant's service and pull its replicas around)."""
    spec = event.spec
    name = spec.labels.get(SERVICE_LABEL)
    if spec.kind is not JobKind.INFERENCE_SERVICE or not name:
        return None
    return f"{spec.tenant}/{name}"


def cluster_and_nodes(event: ClusterCapacity) -> tuple[Cluster, dict[NodeId, Node]]:
    cluster_id = ClusterId(event.cluster)
    prices = {
        (acc_type, PriceTier(tier)): price
        for acc_type, tiers in event.prices.items()
        for tier, price in tiers.items()
    }
    cluster = Cluster(cluster_id, event.location, ClusterKind(event.kind), prices)
    nodes = {
        NodeId(n.node_id): Node(
            node_id=NodeId(n.node_id),
            cluster=cluster_id,
            block=n.block,
            rack=n.rack,
            nvlink_domain=n.nvlink_domain,
            accelerator=AcceleratorModel(
                n.accelerator_type, n.generation, n.accelerator_memory_gb, n.relative_speed
            ),
            accelerators=n.accelerators,
            cpu=n.cpu,
            memory_gb=n.memory_gb,
            price_tier=PriceTier(n.price_tier),
            healthy=n.healthy,
        )
        for n in event.nodes
    }
    return cluster, nodes


def placement_event(
    alloc: Allocation,
    queued: JobQueued,
    *,
    attempt: int,
    epoch: int,
    leader: str,
    accelerator_type: str,
) -> PlacementDecided:
    return PlacementDecided(
        job_id=alloc.job.job_id,
        attempt=attempt,
        epoch=epoch,
        leader=leader,
        cluster=alloc.cluster,
        accelerator_type=accelerator_type,
        replicas=[
            ReplicaAssignment(
                replica=r.replica,
                node_id=r.node_id,
                accelerators=r.accelerators,
                cpu=r.cpu,
                memory_gb=r.memory_gb,
                devices=list(r.devices),
            )
            for r in alloc.replicas
        ],
        spec=queued.spec,
    )


def allocation_from_event(p: PlacementHead, request: JobRequest, at: float) -> Allocation:
    return Allocation(
        job=request,
        cluster=ClusterId(p.cluster),
        replicas=tuple(
            ReplicaPlacement(
                r.replica,
                NodeId(r.node_id),
                r.accelerators,
                r.cpu,
                r.memory_gb,
                tuple(r.devices),
            )
            for r in p.replicas
        ),
        start_time=at,
    )
