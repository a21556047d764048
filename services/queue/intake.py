"""Turning one batch of raw records into typed items for the queue, dead-lettering the rest."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from aiokafka import ConsumerRecord
from pydantic import BaseModel, ValidationError

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobCancelRequested,
    JobFinished,
    JobPreempted,
    JobRejected,
    JobStarted,
    PlacementHead,
    PlacementRefused,
    RejectReason,
    RunFailed,
)
from schemas.usage import BudgetExceeded
from schemas.validation import (
    Submission,
    Unparseable,
    describe_validation_error,
    parse_submission,
)
from services.common.deadletter import dead_letter, decode_envelopes
from services.common.kafka import OutMessage, envelope_for
from services.common.tracing import incoming

CONSUMER = "queue"

LIFECYCLE_PAYLOADS: dict[str, type[BaseModel]] = {
    topics.JOB_CANCEL_REQUESTED: JobCancelRequested,
    topics.PLACEMENT_DECIDED: PlacementHead,
    topics.PLACEMENT_REFUSED: PlacementRefused,
    topics.JOB_STARTED: JobStarted,
    topics.JOB_FINISHED: JobFinished,
    topics.JOB_PREEMPTED: JobPreempted,
    topics.JOB_RUN_FAILED: RunFailed,
    topics.BUDGET_EXCEEDED: BudgetExceeded,
}
# Two consumers: requests (submissions and cancels, on every job's critical path) are never
# held up behind the larger stream of lifecycle events that follow placements.
REQUEST_TOPICS = (topics.JOB_SUBMITTED, topics.JOB_CANCEL_REQUESTED)
LIFECYCLE_TOPICS = tuple(t for t in LIFECYCLE_PAYLOADS if t != topics.JOB_CANCEL_REQUESTED)

_ID_NAMESPACE = uuid.UUID("6f1c2b0e-8d0a-4c4e-9d1e-5b7a0f6c2a11")


@dataclass(frozen=True)
class NewJob:
    event_id: str
    job_id: str
    submission: Submission
    traceparent: str | None = None  # the trace it continues (services.common.tracing)


@dataclass(frozen=True)
class BadJob:
    event_id: str
    bad: Unparseable
    dead: OutMessage


@dataclass(frozen=True)
class LifecycleEvent:
    envelope: Envelope
    payload: Any  # one of LIFECYCLE_PAYLOADS' types; has .job_id


Item = NewJob | BadJob | LifecycleEvent


def record_identity(record: ConsumerRecord[Any, Any]) -> str:
    """Stable across redelivery of the same record, distinct after a broker restart."""
    coords = f"{record.topic}/{record.partition}/{record.offset}/{record.timestamp}"
    return str(uuid.uuid5(_ID_NAMESPACE, coords))


def read_batch(
    records: tuple[ConsumerRecord[Any, Any], ...],
) -> tuple[list[Item], list[OutMessage]]:
    items: list[Item] = []
    dead: list[OutMessage] = []
    lifecycle: list[ConsumerRecord[Any, Any]] = []
    for record in records:
        if record.topic == topics.JOB_SUBMITTED:
            items.append(_read_submission(record))
        else:
            lifecycle.append(record)
    decoded, undecodable = decode_envelopes(
        tuple(lifecycle), consumer=CONSUMER, models=LIFECYCLE_PAYLOADS
    )
    dead.extend(undecodable)
    for got in decoded:
        model = LIFECYCLE_PAYLOADS[got.record.topic]
        try:
            payload = model.model_validate(got.envelope.payload)
        except ValidationError as exc:
            dead.append(dead_letter(got.record, describe_validation_error(exc), consumer=CONSUMER))
            continue
        items.append(LifecycleEvent(got.envelope, payload))
    return items, dead


def _read_submission(record: ConsumerRecord[Any, Any]) -> Item:
    parsed = parse_submission(record.value or b"")
    identity = record_identity(record)
    if isinstance(parsed, Unparseable):
        return BadJob(
            identity,
            parsed,
            dead_letter(
                record,
                f"{parsed.reason.value}: {parsed.message}",
                consumer=CONSUMER,
                tenant=parsed.tenant,
                reason="too_large" if parsed.reason is RejectReason.TOO_LARGE else "unreadable",
            ),
        )
    # A bare spec carries no event id: the record's coordinates stand in for one.
    event_id = identity if parsed.bare else parsed.envelope.event_id
    job_id = parsed.spec.job_id or identity
    return NewJob(event_id, job_id, parsed, incoming(record.headers, parsed.envelope))


_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def _safe(value: str | None) -> str | None:
    return value if value is not None and _SAFE_ID.fullmatch(value) else None


def answer_given_up(record: ConsumerRecord[Any, Any], error: str) -> list[OutMessage]:
    """The submitter's answer when the queue gave a submission up (it could not be stored):
    a `job.rejected` (reason `unprocessable`) under the job id the queue would have used, so
    the job does not stay `submitted` for good. Ids taken from the record only when they are
    plainly safe; nothing here may fail on what the record holds."""
    if record.topic != topics.JOB_SUBMITTED:
        return []
    job_id: str | None = record_identity(record)
    tenant = idem = None
    try:
        parsed = parse_submission(record.value or b"")
    except Exception:  # whatever made the queue give up may make this fail too
        parsed = None
    if isinstance(parsed, Unparseable):
        job_id = _safe(parsed.job_id) or job_id
        tenant, idem = _safe(parsed.tenant), _safe(parsed.idempotency_key)
    elif parsed is not None:
        spec = parsed.spec
        job_id = _safe(spec.job_id) or job_id
        tenant, idem = _safe(spec.tenant), _safe(spec.idempotency_key)
    event = JobRejected(
        job_id=job_id,
        reason_code=RejectReason.UNPROCESSABLE,
        message=f"the queue could not store this submission ({error[:500]}); it was dead-lettered",
        idempotency_key=idem,
    )
    return [
        OutMessage(
            topics.JOB_REJECTED,
            job_id or "unknown",
            envelope_for("JobRejected", event, producer=CONSUMER, tenant=tenant),
        )
    ]
