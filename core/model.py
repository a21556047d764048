"""The scheduling core's own model of the fleet and of work: frozen values, no behaviour.

The live scheduler converts wire models (pydantic, `schemas/`) into these at one point; the
simulator builds them directly. Nothing here knows about Kafka, YAML or time sources.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NewType

JobId = NewType("JobId", str)
NodeId = NewType("NodeId", str)
ClusterId = NewType("ClusterId", str)
TenantId = NewType("TenantId", str)


class TopologyLevel(StrEnum):
    """How close the replicas of a gang must sit, tightest first."""

    NODE = "node"
    NVLINK = "nvlink"
    RACK = "rack"
    BLOCK = "block"
    CLUSTER = "cluster"


# Tightest first; widening a preferred constraint walks this tuple.
TOPOLOGY_ORDER: tuple[TopologyLevel, ...] = tuple(TopologyLevel)


class PriceTier(StrEnum):
    RESERVED = "reserved"
    ON_DEMAND = "on_demand"
    SPOT = "spot"


class ClusterKind(StrEnum):
    ON_PREM = "on_prem"
    CLOUD = "cloud"
    EDGE = "edge"


class WorkloadKind(StrEnum):
    TRAINING = "training"
    EVALUATION = "evaluation"
    BATCH_INFERENCE = "batch_inference"
    INFERENCE_SERVICE = "inference_service"


@dataclass(frozen=True)
class AcceleratorModel:
    type: str
    generation: str
    memory_gb: float
    # Throughput relative to a reference device; effective cost is price / relative_speed.
    relative_speed: float = 1.0


@dataclass(frozen=True)
class Cluster:
    cluster_id: ClusterId
    location: str
    kind: ClusterKind
    # Price per accelerator-hour, keyed by (accelerator type, tier).
    prices: Mapping[tuple[str, PriceTier], float] = field(default_factory=dict)


@dataclass(frozen=True)
class Node:
    node_id: NodeId
    cluster: ClusterId
    block: str
    rack: str
    nvlink_domain: str
    accelerator: AcceleratorModel
    accelerators: int
    cpu: float
    memory_gb: float
    price_tier: PriceTier = PriceTier.ON_DEMAND
    healthy: bool = True


@dataclass(frozen=True)
class JobRequest:
    job_id: JobId
    tenant: TenantId
    project: str
    user: str
    queue: str
    priority_class: str
    kind: WorkloadKind
    replicas: int
    # Per replica; a fraction below 1 shares one device with other fractional replicas.
    accelerators: float
    # Acceptable accelerator types; empty means any.
    accelerator_types: tuple[str, ...]
    accelerator_memory_gb: float | None
    cpu: float
    memory_gb: float
    topology: TopologyLevel
    topology_required: bool
    preemptible: bool
    submit_time: float
    max_runtime_s: float | None = None
    # When it last went back to the queue (a requeue after a run ended); None: submit_time.
    # Only how long it has waited this time reads it (core/repack.py), never the order.
    queued_time: float | None = None
    excluded_nodes: frozenset[NodeId] = frozenset()
    # Jobs of one group are kept apart (the replicas of one inference service): placement
    # prefers a node, rack and cluster holding fewer of the group.
    spread_group: str | None = None

    @property
    def total_accelerators(self) -> float:
        return self.replicas * self.accelerators

    @property
    def waiting_since(self) -> float:
        return self.submit_time if self.queued_time is None else self.queued_time


@dataclass(frozen=True)
class ReplicaPlacement:
    replica: int
    node_id: NodeId
    accelerators: float
    cpu: float
    memory_gb: float
    # The node's devices it takes (indices): the executor books exactly these. Empty for a
    # replica without accelerators, or one placed before placements named devices.
    devices: tuple[int, ...] = ()


@dataclass(frozen=True)
class Allocation:
    job: JobRequest
    cluster: ClusterId
    replicas: tuple[ReplicaPlacement, ...]
    start_time: float


@dataclass(frozen=True)
class Snapshot:
    """Everything one scheduling cycle may look at.

    `usage` is each tenant's decayed past consumption in accelerator-seconds (see
    `core.fairshare.decay_usage`); `attained` is each job's attained service in
    accelerator-seconds across all its runs, used by least-attained-service ordering;
    `preempting` names running jobs already ordered to yield, so they are not chosen again;
    `protected` names running jobs that must not be chosen as victims for now (e.g. the
    preemptor just declined to preempt them) but are not leaving either.
    """

    clusters: Mapping[ClusterId, Cluster]
    nodes: Mapping[NodeId, Node]
    running: Mapping[JobId, Allocation]
    pending: Sequence[JobRequest]
    usage: Mapping[TenantId, float] = field(default_factory=dict)
    attained: Mapping[JobId, float] = field(default_factory=dict)
    preempting: frozenset[JobId] = frozenset()
    protected: frozenset[JobId] = frozenset()
