"""The preemptor's outgoing messages, keyed by the victim's job id so that an executor sees a
run's checkpoint request before its stop order; alerts are keyed by their subject (cluster)."""

from __future__ import annotations

from datetime import datetime

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import JobCheckpointRequested, JobPreemptOrdered, PreemptionCanceled
from schemas.health import AlertRaised, Severity
from services.common.kafka import OutMessage, envelope_for
from services.preemptor.guards import Cancel, Order, Request, Signal

PRODUCER = "preemptor"


def cause_of(request_id: str, trace_id: str, tenant: str) -> Envelope:
    """The request's envelope as far as a later event needs it (trace and causation), for
    events the timer emits long after the request was consumed."""
    return Envelope(
        event_id=request_id, type="PreemptionRequested", trace_id=trace_id, tenant=tenant
    )


def checkpoint(req: Request, signal: Signal, cause: Envelope, at: datetime) -> OutMessage:
    """The request to checkpoint, stamped `at`, the moment its deadline (`stop_at`, a grace
    period later) is counted from: the stop order, stamped when the timer finds it due, then
    never looks sooner than the grace, however long the batch took to send the request."""
    cmd = JobCheckpointRequested(
        job_id=req.job_id,
        attempt=req.attempt,
        cluster=req.cluster,
        grace_s=signal.grace_s,
        stop_at=signal.stop_at,
        for_job=req.for_job,
        reason_code=req.reason_code,
    )
    return _out(topics.JOB_CHECKPOINT_REQUESTED, "JobCheckpointRequested", req, cmd, cause, at)


def order(req: Request, decision: Order, cause: Envelope, at: datetime) -> OutMessage:
    cmd = JobPreemptOrdered(
        job_id=req.job_id,
        attempt=req.attempt,
        cluster=req.cluster,
        for_job=req.for_job,
        reason_code=req.reason_code,
        message=decision.message,
    )
    return _out(topics.JOB_PREEMPT_ORDERED, "JobPreemptOrdered", req, cmd, cause, at)


def canceled(req: Request, decision: Cancel, cause: Envelope) -> OutMessage:
    event = PreemptionCanceled(
        job_id=req.job_id,
        attempt=req.attempt,
        for_job=req.for_job,
        reason_code=decision.reason.value,
        message=decision.message,
    )
    return _out(topics.PREEMPTION_CANCELED, "PreemptionCanceled", req, event, cause)


def unanswered(req: Request, ordered_at: datetime, waited_s: float) -> OutMessage:
    """An alert for ops: a stop order no run end has answered (key: the cluster)."""
    alert = AlertRaised(
        alert_id=f"stop-unanswered-{req.id}",
        severity=Severity.WARNING,
        subject=req.cluster,
        cluster=req.cluster,
        cause="stop_order_unanswered",
        suggested_action=(
            f"the executor of cluster {req.cluster} has not ended run {req.attempt} of job "
            f"{req.job_id} {waited_s:.0f} s after it was ordered to stop (to make room for job "
            f"{req.for_job}, {req.reason_code}); that job waits for the capacity. Check the "
            f"executor's health and log (`qm ps`, `qm logs executor-{req.cluster}`) and the "
            f"run's nodes; `qm cancel {req.job_id}` stops the job for good"
        ),
        first_seen=ordered_at,
        count=1,
    )
    env = envelope_for("AlertRaised", alert, producer=PRODUCER, tenant=req.tenant)
    return OutMessage(topics.ALERT_RAISED, req.cluster, env)


def _out(
    topic: str,
    event_type: str,
    req: Request,
    payload: JobCheckpointRequested | JobPreemptOrdered | PreemptionCanceled,
    cause: Envelope,
    at: datetime | None = None,
) -> OutMessage:
    env = envelope_for(
        event_type, payload, producer=PRODUCER, tenant=req.tenant, cause=cause, occurred_at=at
    )
    return OutMessage(topic, req.job_id, env)
