"""Readable builders for the meter's unit tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from schemas.events import ClusterCapacity, NodeInfo, ReplicaAssignment
from services.meter.pricing import PriceBook
from services.meter.runs import Finished, Placed, Started
from services.meter.ticks import Grid, Run, Share, micros

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def grid(interval_s: float = 60, time_scale: float = 1) -> Grid:
    return Grid.of(interval_s, time_scale)


def run(
    count: str = "8",
    price: str = "2.10",
    start: datetime = T0,
    g: Grid | None = None,
    tier: str = "reserved",
    **fields: str,
) -> Run:
    g = g or grid()
    return Run(
        job_id=fields.get("job_id", "job-1"),
        attempt=int(fields.get("attempt", "1")),
        tenant=fields.get("tenant", "vision"),
        project=fields.get("project", "detect"),
        user=fields.get("user", "ada"),
        cluster=fields.get("cluster", "onprem-h100"),
        accelerator_type=fields.get("accelerator_type", "H100"),
        shares=(Share(tier, micros(count), micros(price)),),
        start_v=g.virtual(start),
    )


def book() -> PriceBook:
    """Two H100 nodes (one reserved, one on demand) in onprem-h100, an A100 spot node."""
    return PriceBook(
        node_tiers={"h-0": "reserved", "h-1": "on_demand", "a-0": "spot"},
        configured={
            ("onprem-h100", "H100", "reserved"): micros("2.10"),
            ("onprem-h100", "H100", "on_demand"): micros("4.50"),
        },
        fallback={("A100", "spot"): micros("0.80")},
    )


def placed(
    job_id: str = "job-1",
    attempt: int = 1,
    nodes: dict[str, float] | None = None,
    epoch: int = 1,
    tenant: str = "vision",
    project: str = "detect",
    cluster: str = "onprem-h100",
    accelerator_type: str = "H100",
) -> Placed:
    nodes = nodes if nodes is not None else {"h-0": 8}
    replicas = tuple(
        ReplicaAssignment(replica=i, node_id=n, accelerators=a, cpu=1, memory_gb=1)
        for i, (n, a) in enumerate(sorted(nodes.items()))
    )
    return Placed(
        job_id, attempt, epoch, tenant, project, "ada", cluster, accelerator_type, replicas
    )


def started(
    job_id: str = "job-1", attempt: int = 1, at: datetime = T0, nodes: tuple[str, ...] = ("h-0",)
) -> Started:
    return Started(job_id, attempt, nodes, at)


def finished(
    job_id: str = "job-1",
    attempt: int = 1,
    ran_s: str = "150",
    outcome: str = "succeeded",
    measured: bool = True,
) -> Finished:
    return Finished(job_id, attempt, micros(ran_s), outcome, measured)


def capacity(cluster: str = "onprem-h100") -> ClusterCapacity:
    def node(node_id: str, tier: str) -> NodeInfo:
        return NodeInfo(
            node_id=node_id,
            block="b",
            rack="r",
            nvlink_domain="n",
            accelerator_type="H100",
            generation="hopper",
            accelerator_memory_gb=80,
            relative_speed=3,
            accelerators=8,
            cpu=64,
            memory_gb=512,
            price_tier=tier,
        )

    return ClusterCapacity(
        cluster=cluster,
        location="dc1",
        kind="on_prem",
        prices={"H100": {"reserved": 2.10, "on_demand": 4.50}},
        nodes=[node("h-0", "reserved"), node("h-1", "on_demand")],
    )


def after(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)
