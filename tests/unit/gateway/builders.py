"""Readable builders for the gateway's fleet and queue views."""

from __future__ import annotations

from typing import Any

from aiokafka import ConsumerRecord

from schemas.job import JobState
from services.gateway.occupancy import Holder, NodeFacts
from services.gateway.projection import Placement, ReplicaPlacement


def gpu_nodes(
    count: int, *, gpus: int = 8, type: str = "H100", cluster: str = "c1", **over: Any
) -> list[NodeFacts]:
    """`count` nodes named `<cluster>-<type>-<i>`, two per rack, in block b0."""
    return [
        NodeFacts(
            node_id=f"{cluster}-{type.lower()}-{i}",
            cluster=cluster,
            block="b0",
            rack=f"r{i // 2}",
            nvlink_domain=f"nv{i}",
            accelerator_type=type,
            accelerators=gpus,
            price_tier="on_demand",
            **over,
        )
        for i in range(count)
    ]


def job_on(
    job_id: str,
    *replicas: tuple[str, float, tuple[int, ...]],
    tenant: str = "vision",
    state: JobState = JobState.RUNNING,
    cluster: str = "c1",
    type: str = "H100",
    attempt: int = 1,
) -> Holder:
    """A job holding (node, accelerators, devices) per replica."""
    placement = Placement(
        attempt=attempt,
        cluster=cluster,
        accelerator_type=type,
        replicas=tuple(ReplicaPlacement(i, n, a, d) for i, (n, a, d) in enumerate(replicas)),
    )
    return Holder(job_id, tenant, state, placement)


def record(
    topic: str, value: bytes, offset: int = 0, key: str | None = None
) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic=topic,
        partition=0,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=key.encode() if key else None,
        value=value,
        checksum=None,
        serialized_key_size=len(key or ""),
        serialized_value_size=len(value),
        headers=[],
    )
