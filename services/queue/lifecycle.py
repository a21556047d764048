"""The job state machine as the queue keeps it: each event in, the new record, the history
line and the events to announce out. Pure apart from stamping new envelopes.

Events about one job arrive on several topics, so their relative order is not guaranteed:
transitions only move forward (by rank), and an event for an older attempt changes nothing.
What follows a run that ends before its job is done (preempted, failed): services.queue.retries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobCancelRequested,
    JobFinished,
    JobQueued,
    JobStarted,
    JobStopOrdered,
    Outcome,
    PlacementHead,
    PlacementRefused,
)
from schemas.job import JobSpec, JobState
from services.common.frozen import evolve
from services.common.kafka import OutMessage, envelope_for

PRODUCER = "queue"

_RANK = {
    JobState.SUBMITTED: 0,
    JobState.QUEUED: 1,
    JobState.PLACED: 2,
    JobState.RUNNING: 3,
    JobState.PREEMPTING: 3,
}


@dataclass
class JobRecord:
    job_id: str
    tenant: str
    state: JobState
    submitted_at: datetime
    updated_at: datetime
    attempt: int = 0
    cluster: str | None = None
    cancel_requested: bool = False
    reason_code: str | None = None
    message: str | None = None
    requeues: int = 0
    excluded_nodes: tuple[str, ...] = ()
    ended_attempt: int = 0  # the last run that ended; its late events change nothing
    failures: int = 0  # runs that failed by the job's own fault (charged to spec.retry)
    claim_preemptions: int = 0  # runs preempted for a higher claim (they back off)


@dataclass(frozen=True)
class HistoryEntry:
    job_id: str
    at: datetime
    state: JobState
    event_type: str
    event_id: str
    reason_code: str | None = None
    message: str | None = None


@dataclass
class Step:
    """What applying one event produced."""

    record: JobRecord
    history: list[HistoryEntry] = field(default_factory=list)
    emits: list[OutMessage] = field(default_factory=list)
    spec: JobSpec | None = None  # the job's spec, when this step changed it (kept for requeues)


def _rank(state: JobState) -> int:
    return 4 if state.terminal else _RANK[state]


def note(step: Step, env: Envelope, reason: str | None = None, message: str | None = None) -> None:
    rec = step.record
    step.history.append(
        HistoryEntry(
            rec.job_id, env.occurred_at, rec.state, env.type, env.event_id, reason, message
        )
    )


def _stop(rec: JobRecord, env: Envelope, reason: str) -> OutMessage:
    cmd = JobStopOrdered(job_id=rec.job_id, reason=reason)
    return OutMessage(
        topics.JOB_STOP_ORDERED,
        rec.job_id,
        envelope_for("JobStopOrdered", cmd, producer=PRODUCER, tenant=rec.tenant, cause=env),
    )


def finish(rec: JobRecord, env: Envelope, outcome: Outcome, reason: str, msg: str) -> OutMessage:
    # The queue ends the *job* (no run of it is going on), so the event names no attempt:
    # consumers that skip the ends of old runs by attempt must not skip this one.
    done = JobFinished(
        job_id=rec.job_id,
        outcome=outcome,
        reason_code=reason,
        message=msg,
        attempt=None,
        cluster=rec.cluster,
    )
    return OutMessage(
        topics.JOB_FINISHED,
        rec.job_id,
        envelope_for("JobFinished", done, producer=PRODUCER, tenant=rec.tenant, cause=env),
    )


def cancel_now(step: Step, env: Envelope, message: str) -> None:
    """A cancel was waiting for the run to end; it has: the job ends canceled."""
    step.record = evolve(
        step.record,
        state=JobState.CANCELED,
        reason_code="canceled",
        message=message,
        updated_at=env.occurred_at,
    )
    step.emits.append(finish(step.record, env, Outcome.CANCELED, "canceled", message))


STALE_EPOCH = "stale_epoch"  # the executor's reason code for a deposed leader's placement


def on_placed(rec: JobRecord, p: PlacementHead, env: Envelope) -> Step:
    step = Step(rec)
    if rec.state is JobState.CANCELED or rec.cancel_requested:
        step.emits.append(_stop(rec, env, "canceled"))
        note(step, env, "stop_ordered", f"placed on {p.cluster} after cancel; stop ordered")
        return step
    if rec.state.terminal or p.attempt < rec.attempt or p.attempt <= rec.ended_attempt:
        return step
    if _rank(rec.state) <= _rank(JobState.PLACED):
        step.record = evolve(
            rec,
            state=JobState.PLACED,
            attempt=p.attempt,
            cluster=p.cluster,
            updated_at=env.occurred_at,
        )
    nodes = sorted({r.node_id for r in p.replicas})
    note(step, env, None, f"placed on {p.cluster}: {', '.join(nodes)}")
    return step


def on_refused(rec: JobRecord, p: PlacementRefused, env: Envelope) -> Step:
    step = Step(rec)
    if p.reason_code == STALE_EPOCH:
        # A deposed leader's placement. Its successor may have placed this same attempt (the
        # run we are waiting for), and if it had not, it places the job again: either way
        # the job's state moves with the next placement, not with this refusal.
        note(step, env, p.reason_code, p.message)
        return step
    if rec.state is not JobState.PLACED or p.attempt != rec.attempt:
        return step
    if rec.cancel_requested:
        cancel_now(step, env, "canceled before it started")
    else:
        step.record = evolve(rec, state=JobState.QUEUED, updated_at=env.occurred_at)
    note(step, env, p.reason_code, p.message)
    return step


def on_started(rec: JobRecord, p: JobStarted, env: Envelope) -> Step:
    step = Step(rec)
    if rec.state is JobState.CANCELED:
        step.emits.append(_stop(rec, env, "canceled"))
        note(step, env, "stop_ordered", "started after cancel; stop ordered")
        return step
    if rec.state.terminal or p.attempt < rec.attempt or p.attempt <= rec.ended_attempt:
        return step
    step.record = evolve(
        rec,
        state=JobState.RUNNING,
        attempt=p.attempt,
        cluster=p.cluster,
        updated_at=env.occurred_at,
    )
    note(step, env, None, f"running on {len(p.nodes)} node(s) in {p.cluster}")
    return step


def on_finished(rec: JobRecord, p: JobFinished, env: Envelope) -> Step:
    step = Step(rec)
    if rec.state.terminal:
        return step
    if p.attempt is not None and (p.attempt < rec.attempt or p.attempt <= rec.ended_attempt):
        return step  # an older run's end, or one the platform already ended and requeued
    step.record = evolve(
        rec,
        state=JobState(p.outcome.value),
        reason_code=p.reason_code,
        message=p.message,
        updated_at=env.occurred_at,
    )
    note(step, env, p.reason_code, p.message)
    return step


def on_cancel(rec: JobRecord, p: JobCancelRequested, env: Envelope) -> Step:
    step = Step(rec)
    if rec.state.terminal:
        note(step, env, "cancel_ignored", f"cancel ignored: job already {rec.state.value}")
        return step
    who = p.requested_by
    if _rank(rec.state) <= _rank(JobState.QUEUED):
        msg = f"canceled by {who} while {rec.state.value}"
        step.record = evolve(
            rec,
            state=JobState.CANCELED,
            reason_code="canceled",
            message=msg,
            updated_at=env.occurred_at,
        )
        step.emits.append(finish(step.record, env, Outcome.CANCELED, "canceled", msg))
        # A placement may already be in flight: make sure it is stopped wherever it lands.
        step.emits.append(_stop(step.record, env, "canceled"))
    else:
        step.record = evolve(rec, cancel_requested=True, updated_at=env.occurred_at)
        step.emits.append(_stop(rec, env, "canceled"))
        msg = f"cancel requested by {who}; stopping on {rec.cluster}"
    note(step, env, "canceled", msg)
    return step


def ended_before(rec: JobRecord, attempt: int) -> bool:
    """An older run, or one already ended: its end changes nothing (it may be read before
    its run's placement, on another topic, so it is taken by its own attempt)."""
    return attempt < rec.attempt or attempt <= rec.ended_attempt


def requeue(
    step: Step,
    env: Envelope,
    spec: JobSpec,
    ended: int,
    *,
    failed_nodes: Sequence[str] = (),
    not_before: datetime | None = None,
) -> int:
    """Run `ended` is over and the job waits again: `job.queued` with the original submit
    time, the nodes to avoid and, on a backoff, the wall-clock time before which it is not
    placed. Returns the requeue's number (the JobQueued's attempt)."""
    rec = step.record
    excluded = tuple(dict.fromkeys((*rec.excluded_nodes, *failed_nodes)))
    number = rec.requeues + 1
    step.record = evolve(
        rec,
        state=JobState.QUEUED,
        requeues=number,
        excluded_nodes=excluded,
        attempt=ended,
        ended_attempt=ended,
        updated_at=env.occurred_at,
    )
    queued = JobQueued(
        job_id=rec.job_id,
        spec=spec,
        submitted_at=rec.submitted_at,
        attempt=number,
        requeue_of_attempt=ended,
        excluded_nodes=list(excluded),
        not_before=not_before,
        queued_at=env.occurred_at,
    )
    step.emits.append(
        OutMessage(
            topics.JOB_QUEUED,
            rec.job_id,
            envelope_for("JobQueued", queued, producer=PRODUCER, tenant=rec.tenant, cause=env),
        )
    )
    return number
