"""Turning one batch of raw records into what the decisions read, dead-lettering the rest.
The one conversion point from wire models to the decisions' dataclasses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from aiokafka import ConsumerRecord
from pydantic import BaseModel, ValidationError

from schemas import topics
from schemas.events import ClusterCapacity, JobProgress, NodeHeartbeat
from schemas.health import NodeProbe
from schemas.validation import describe_validation_error
from services.common.deadletter import dead_letter, decode_envelopes
from services.common.kafka import OutMessage
from services.health.book import Beat, Seen
from services.health.pace import Progress, ReplicaStep

CONSUMER = "health"

PAYLOADS: dict[str, type[BaseModel]] = {
    topics.NODE_HEARTBEAT: NodeHeartbeat,
    topics.NODE_PROBE: NodeProbe,
    topics.CLUSTER_CAPACITY: ClusterCapacity,
    topics.JOB_PROGRESS: JobProgress,
}
TOPICS = tuple(PAYLOADS)


@dataclass(frozen=True)
class Inventory:
    cluster: str
    node_ids: tuple[str, ...]
    at: datetime


@dataclass
class Batch:
    beats: list[Beat] = field(default_factory=list)
    probes: list[tuple[str, Seen]] = field(default_factory=list)  # (event id, probe)
    inventories: list[Inventory] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)
    dead: list[OutMessage] = field(default_factory=list)


def read_batch(records: tuple[ConsumerRecord[Any, Any], ...], now: datetime) -> Batch:
    batch = Batch()
    decoded, batch.dead = decode_envelopes(records, consumer=CONSUMER, models=PAYLOADS)
    for got in decoded:
        try:
            payload = PAYLOADS[got.record.topic].model_validate(got.envelope.payload)
        except ValidationError as exc:
            error = describe_validation_error(exc)
            batch.dead.append(dead_letter(got.record, error, consumer=CONSUMER))
            continue
        # The sender's clock, but never ahead of ours: a skewed node must not be able to
        # postpone its own silence or recovery checks.
        at = min(got.envelope.occurred_at, now)
        if isinstance(payload, NodeHeartbeat):
            batch.beats.append(Beat(payload.node_id, payload.cluster, at))
        elif isinstance(payload, NodeProbe):
            seen = Seen(
                payload.node_id,
                payload.cluster,
                payload.kind,
                payload.xid,
                payload.device,
                payload.detail,
                at,
            )
            batch.probes.append((got.envelope.event_id, seen))
        elif isinstance(payload, ClusterCapacity):
            ids = tuple(n.node_id for n in payload.nodes)
            batch.inventories.append(Inventory(payload.cluster, ids, at))
        elif isinstance(payload, JobProgress):
            problem = progress_problem(payload)
            if problem is not None:
                batch.dead.append(dead_letter(got.record, problem, consumer=CONSUMER))
                continue
            steps = tuple(
                ReplicaStep(r.replica, r.node_id, r.step_time_s) for r in payload.replicas
            )
            batch.progress.append(
                Progress(payload.job_id, payload.attempt, payload.cluster, steps, at)
            )
    return batch


def progress_problem(report: JobProgress) -> str | None:
    """What makes a well-formed report unusable; the detector divides by these step times."""
    for i, r in enumerate(report.replicas):
        if not (math.isfinite(r.step_time_s) and r.step_time_s > 0):
            return f"replicas.{i}.step_time_s: must be a number > 0, got {r.step_time_s}"
    numbers = [r.replica for r in report.replicas]
    if len(set(numbers)) != len(numbers):
        return f"replicas: replica numbers repeat: {sorted(numbers)}"
    return None
