"""Turning a batch of raw records into the meter's facts (the one conversion point from wire
payloads), dead-lettering what cannot be read."""

from __future__ import annotations

from typing import Any

from aiokafka import ConsumerRecord
from pydantic import BaseModel, ValidationError

from schemas import topics
from schemas.events import (
    ClusterCapacity,
    JobFinished,
    JobPreempted,
    JobStarted,
    PlacementHead,
    PlacementRefused,
    RunFailed,
)
from schemas.validation import describe_validation_error
from services.common.deadletter import dead_letter, decode_envelopes
from services.common.kafka import OutMessage
from services.meter.runs import Capacity, Fact, Finished, Placed, Refused, Started
from services.meter.ticks import micros

CONSUMER = "meter"

PAYLOADS: dict[str, type[BaseModel]] = {
    topics.PLACEMENT_DECIDED: PlacementHead,
    topics.PLACEMENT_REFUSED: PlacementRefused,
    topics.JOB_STARTED: JobStarted,
    topics.JOB_FINISHED: JobFinished,
    topics.JOB_PREEMPTED: JobPreempted,
    topics.JOB_RUN_FAILED: RunFailed,
    topics.CLUSTER_CAPACITY: ClusterCapacity,
}
TOPICS = tuple(PAYLOADS)


def _fact(payload: Any, producer: str) -> Fact | None:
    if isinstance(payload, PlacementHead):
        s = payload.spec
        return Placed(
            payload.job_id,
            payload.attempt,
            payload.epoch,
            s.tenant,
            s.project,
            s.user,
            payload.cluster,
            payload.accelerator_type,
            tuple(payload.replicas),
        )
    if isinstance(payload, PlacementRefused):
        return Refused(payload.job_id, payload.attempt, payload.epoch)
    if isinstance(payload, JobStarted):
        return Started(payload.job_id, payload.attempt, tuple(payload.nodes), payload.started_at)
    if isinstance(payload, JobFinished):
        if payload.attempt is None:
            return None  # ended before any run: nothing to meter
        measured = producer.startswith("executor") or payload.ran_s > 0
        return Finished(
            payload.job_id, payload.attempt, micros(payload.ran_s), payload.outcome.value, measured
        )
    if isinstance(payload, JobPreempted):
        # The platform ended the run (node failure, room for a higher claim); the job is
        # requeued and its next attempt is another run.
        measured = producer.startswith("executor") or payload.ran_s > 0
        return Finished(
            payload.job_id, payload.attempt, micros(payload.ran_s), "preempted", measured
        )
    if isinstance(payload, RunFailed):
        # The job's own run failed (exit code, out of memory): the run is over and billed,
        # whether or not the queue retries the job (a retry is another attempt).
        measured = producer.startswith("executor") or payload.ran_s > 0
        return Finished(payload.job_id, payload.attempt, micros(payload.ran_s), "failed", measured)
    if isinstance(payload, ClusterCapacity):
        return Capacity(payload)
    return None


def read_batch(
    records: tuple[ConsumerRecord[Any, Any], ...],
) -> tuple[list[tuple[str, Fact]], list[OutMessage]]:
    """(event id, fact) for every record the meter can use, and dead letters for the rest."""
    received, dead = decode_envelopes(records, consumer=CONSUMER, models=PAYLOADS)
    facts: list[tuple[str, Fact]] = []
    for got in received:
        model = PAYLOADS.get(got.record.topic)
        if model is None:
            continue
        try:
            payload = model.model_validate(got.envelope.payload)
        except ValidationError as exc:
            dead.append(dead_letter(got.record, describe_validation_error(exc), consumer=CONSUMER))
            continue
        fact = _fact(payload, got.envelope.producer)
        if fact is not None:
            facts.append((got.envelope.event_id, fact))
    return facts, dead
