"""Turning a batch of raw records into what the preemptor decides on: requests, job facts,
run ends and leader epochs, dead-lettering what cannot be read. The one conversion point from
wire payloads to the decisions' dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiokafka import ConsumerRecord
from pydantic import BaseModel, ValidationError

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobFinished,
    JobPreempted,
    JobStarted,
    LeaderFence,
    PlacementHead,
    PreemptionRequested,
    RunFailed,
)
from schemas.validation import describe_validation_error
from services.common.deadletter import dead_letter, decode_envelopes
from services.common.kafka import OutMessage
from services.preemptor.guards import JobFacts, Request

CONSUMER = "preemptor"

PAYLOADS: dict[str, type[BaseModel]] = {
    topics.PREEMPTION_REQUESTED: PreemptionRequested,
    topics.PLACEMENT_DECIDED: PlacementHead,
    topics.JOB_STARTED: JobStarted,
    topics.JOB_FINISHED: JobFinished,
    topics.JOB_PREEMPTED: JobPreempted,
    topics.JOB_RUN_FAILED: RunFailed,
}
TOPICS = tuple(PAYLOADS)


@dataclass(frozen=True)
class Incoming:
    """A request with the envelope it came in (its trace, tenant and time)."""

    envelope: Envelope
    payload: PreemptionRequested
    request: Request


@dataclass(frozen=True)
class RunEnd:
    """A run (or, with no attempt, the whole job) ended; `how` is the topic that said so."""

    job_id: str
    attempt: int | None
    how: str


@dataclass
class Batch:
    requests: list[Incoming] = field(default_factory=list)
    facts: dict[str, JobFacts] = field(default_factory=dict)  # merged per job
    ends: list[RunEnd] = field(default_factory=list)
    epoch: int = 0  # highest leader epoch among the placements and fences
    dead: list[OutMessage] = field(default_factory=list)

    def add_fact(self, fact: JobFacts) -> None:
        known = self.facts.get(fact.job_id)
        self.facts[fact.job_id] = fact if known is None else known.merge(fact)


def aware(at: datetime) -> datetime:
    """Times without a zone (from a careless external producer) are taken as UTC."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def to_request(event_id: str, occurred_at: datetime, p: PreemptionRequested) -> Request:
    return Request(
        id=event_id,
        job_id=p.job_id,
        attempt=p.attempt,
        cluster=p.cluster,
        tenant=p.tenant,
        priority_class=p.priority_class,
        claim=p.claim.key(),
        for_job=p.for_job,
        for_priority_class=p.for_priority_class,
        for_claim=p.for_claim.key(),
        reason_code=p.reason_code,
        grace_s=p.grace_s,
        epoch=p.epoch,
        requested_at=aware(occurred_at),
        for_tenant=p.for_tenant,
    )


def read_batch(records: tuple[ConsumerRecord[Any, Any], ...]) -> Batch:
    batch = Batch()
    fences: list[LeaderFence] = []
    received, batch.dead = decode_envelopes(
        records, consumer=CONSUMER, fences=fences, models=PAYLOADS
    )
    # A new scheduler leader's fence raises the epoch as its placements would.
    batch.epoch = max((f.epoch for f in fences), default=0)
    for got in received:
        try:
            payload = PAYLOADS[got.record.topic].model_validate(got.envelope.payload)
        except ValidationError as exc:
            error = describe_validation_error(exc)
            batch.dead.append(
                dead_letter(got.record, error, consumer=CONSUMER, tenant=got.envelope.tenant)
            )
            continue
        _fold(batch, got.envelope, payload)
    return batch


def _fold(batch: Batch, env: Envelope, payload: Any) -> None:
    if isinstance(payload, PreemptionRequested):
        batch.requests.append(
            Incoming(env, payload, to_request(env.event_id, env.occurred_at, payload))
        )
    elif isinstance(payload, PlacementHead):
        batch.epoch = max(batch.epoch, payload.epoch)
        batch.add_fact(
            JobFacts(
                payload.job_id,
                placed_at=aware(env.occurred_at),
                preemptible=payload.spec.preemptible,
            )
        )
    elif isinstance(payload, JobStarted):
        batch.add_fact(
            JobFacts(
                payload.job_id,
                started_attempt=payload.attempt,
                started_at=aware(payload.started_at),
                placed_at=aware(payload.started_at),
            )
        )
    elif isinstance(payload, JobFinished):
        batch.add_fact(
            JobFacts(
                payload.job_id,
                ended_attempt=payload.attempt,
                finished=True,
                closed=payload.attempt is None,
            )
        )
        batch.ends.append(RunEnd(payload.job_id, payload.attempt, topics.JOB_FINISHED))
    elif isinstance(payload, JobPreempted | RunFailed):
        batch.add_fact(JobFacts(payload.job_id, ended_attempt=payload.attempt))
        how = topics.JOB_PREEMPTED if isinstance(payload, JobPreempted) else topics.JOB_RUN_FAILED
        batch.ends.append(RunEnd(payload.job_id, payload.attempt, how))
