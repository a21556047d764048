"""The preemptor's outgoing messages, all keyed by the victim's job id so that an executor sees
a run's checkpoint request before its stop order."""

from __future__ import annotations

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import JobCheckpointRequested, JobPreemptOrdered, PreemptionCanceled
from services.common.kafka import OutMessage, envelope_for
from services.preemptor.guards import Cancel, Order, Request, Signal

PRODUCER = "preemptor"


def cause_of(request_id: str, trace_id: str, tenant: str) -> Envelope:
    """The request's envelope as far as a later event needs it (trace and causation), for
    events the timer emits long after the request was consumed."""
    return Envelope(
        event_id=request_id, type="PreemptionRequested", trace_id=trace_id, tenant=tenant
    )


def checkpoint(req: Request, signal: Signal, cause: Envelope) -> OutMessage:
    cmd = JobCheckpointRequested(
        job_id=req.job_id,
        attempt=req.attempt,
        cluster=req.cluster,
        grace_s=signal.grace_s,
        stop_at=signal.stop_at,
        for_job=req.for_job,
        reason_code=req.reason_code,
    )
    return _out(topics.JOB_CHECKPOINT_REQUESTED, "JobCheckpointRequested", req, cmd, cause)


def order(req: Request, decision: Order, cause: Envelope) -> OutMessage:
    cmd = JobPreemptOrdered(
        job_id=req.job_id,
        attempt=req.attempt,
        cluster=req.cluster,
        for_job=req.for_job,
        reason_code=req.reason_code,
        message=decision.message,
    )
    return _out(topics.JOB_PREEMPT_ORDERED, "JobPreemptOrdered", req, cmd, cause)


def canceled(req: Request, decision: Cancel, cause: Envelope) -> OutMessage:
    event = PreemptionCanceled(
        job_id=req.job_id,
        attempt=req.attempt,
        for_job=req.for_job,
        reason_code=decision.reason.value,
        message=decision.message,
    )
    return _out(topics.PREEMPTION_CANCELED, "PreemptionCanceled", req, event, cause)


def _out(
    topic: str,
    event_type: str,
    req: Request,
    payload: JobCheckpointRequested | JobPreemptOrdered | PreemptionCanceled,
    cause: Envelope,
) -> OutMessage:
    env = envelope_for(event_type, payload, producer=PRODUCER, tenant=req.tenant, cause=cause)
    return OutMessage(topic, req.job_id, env)
