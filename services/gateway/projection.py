"""The gateway's read model of a job, folded from lifecycle events. Pure.

Like the queue, it only moves a job forward, because events about one job arrive on several
topics whose relative order is not guaranteed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from schemas.envelope import Envelope
from schemas.events import (
    JobCancelRequested,
    JobCheckpointRequested,
    JobFinished,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobStarted,
    PlacementDecided,
    PlacementRefused,
    PreemptionCanceled,
    RunFailed,
)
from schemas.job import JobSpec, JobState

_RANK = {JobState.SUBMITTED: 0, JobState.QUEUED: 1, JobState.PLACED: 2, JobState.RUNNING: 3}


def rank(state: JobState) -> int:
    return 4 if state.terminal else _RANK.get(state, 3)


@dataclass(frozen=True)
class JobView:
    job_id: str
    tenant: str
    state: JobState
    submitted_at: datetime
    updated_at: datetime
    spec: JobSpec | None = None
    attempt: int = 0
    ended_attempt: int = 0  # the last run the platform ended; its late events change nothing
    reason_code: str | None = None
    message: str | None = None
    cluster: str | None = None
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class EventLine:
    event_id: str
    job_id: str
    at: datetime
    type: str
    state: JobState | None
    reason_code: str | None = None
    message: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "job_id": self.job_id,
            "at": self.at.isoformat(),
            "type": self.type,
            "state": self.state.value if self.state else None,
            "reason_code": self.reason_code,
            "message": self.message,
        }


def submitted_view(spec: JobSpec, job_id: str, at: datetime) -> JobView:
    return JobView(job_id, spec.tenant, JobState.SUBMITTED, at, at, spec=spec)


def project(view: JobView | None, env: Envelope, payload: Any) -> tuple[JobView | None, EventLine]:
    at = env.occurred_at
    job_id = str(payload.job_id)
    new = _fold(view, env, payload, at)
    state = new.state if new is not None else None
    reason, message = _words(payload, new)
    return new, EventLine(env.event_id, job_id, at, env.type, state, reason, message)


def _advance(view: JobView, state: JobState, at: datetime, **changes: Any) -> JobView:
    if rank(state) < rank(view.state) or view.state.terminal:
        return view
    return replace(view, state=state, updated_at=max(at, view.updated_at), **changes)


def _fold(view: JobView | None, env: Envelope, p: Any, at: datetime) -> JobView | None:
    if isinstance(p, JobQueued):
        base = view or JobView(p.job_id, p.spec.tenant, JobState.SUBMITTED, p.submitted_at, at)
        base = replace(base, spec=base.spec or p.spec)
        requeued = p.requeue_of_attempt is not None and p.requeue_of_attempt >= base.attempt
        if requeued and not base.state.terminal:
            # The platform ended the run: the one step back a job takes.
            return replace(
                base,
                state=JobState.QUEUED,
                updated_at=max(at, base.updated_at),
                ended_attempt=max(base.ended_attempt, p.requeue_of_attempt or 0),
            )
        return _advance(base, JobState.QUEUED, at)
    if isinstance(p, JobRejected):
        if view is not None and (view.tenant != env.tenant or view.state is not JobState.SUBMITTED):
            # Only a job still being submitted can be rejected; anything else is a message about
            # someone else's job id (a bad spec from another producer reusing it).
            return view
        tenant = view.tenant if view else (env.tenant or "unknown")
        base = view or JobView(str(p.job_id), tenant, JobState.SUBMITTED, at, at)
        return _advance(
            base, JobState.REJECTED, at, reason_code=p.reason_code.value, message=p.message
        )
    if view is None:
        return None  # lifecycle of a job this gateway has not heard of yet
    if isinstance(p, PlacementDecided):
        if p.attempt < view.attempt or p.attempt <= view.ended_attempt:
            return view
        nodes = tuple(sorted({r.node_id for r in p.replicas}))
        return _advance(
            view, JobState.PLACED, at, attempt=p.attempt, cluster=p.cluster, nodes=nodes
        )
    if isinstance(p, JobCheckpointRequested):
        # The preemptor asked the run to checkpoint: it is stopped when the grace period ends.
        if p.attempt == view.attempt and view.state is JobState.RUNNING:
            return replace(view, state=JobState.PREEMPTING, updated_at=max(at, view.updated_at))
        return view
    if isinstance(p, PreemptionCanceled):
        if p.attempt == view.attempt and view.state is JobState.PREEMPTING:
            return replace(view, state=JobState.RUNNING, updated_at=max(at, view.updated_at))
        return view
    if isinstance(p, JobPreempted):
        leaving = (JobState.PLACED, JobState.RUNNING, JobState.PREEMPTING)
        if p.attempt == view.attempt and view.state in leaving:
            return replace(
                view,
                state=JobState.QUEUED,
                updated_at=max(at, view.updated_at),
                ended_attempt=p.attempt,
            )
        return view
    if isinstance(p, RunFailed):
        # The queue decides whether the job is retried (job.queued) or ends (job.finished);
        # until then the state stays, but late events of this run move the job no more.
        if view.state.terminal or p.attempt <= view.ended_attempt or p.attempt < view.attempt:
            return view
        return replace(view, ended_attempt=p.attempt, updated_at=max(at, view.updated_at))
    if isinstance(p, PlacementRefused):
        # A deposed leader's copy moves nothing: its successor's placement (of this attempt or
        # the next) does (queue.lifecycle.on_refused).
        if p.reason_code == "stale_epoch":
            return view
        if view.state is JobState.PLACED and p.attempt == view.attempt:
            return replace(view, state=JobState.QUEUED, updated_at=at)
        return view
    if isinstance(p, JobStarted):
        if p.attempt < view.attempt or p.attempt <= view.ended_attempt:
            return view
        return _advance(
            view, JobState.RUNNING, at, attempt=p.attempt, cluster=p.cluster, nodes=tuple(p.nodes)
        )
    if isinstance(p, JobFinished):
        return _advance(
            view, JobState(p.outcome.value), at, reason_code=p.reason_code, message=p.message
        )
    return view  # JobCancelRequested changes nothing until the job actually stops


def _words(p: Any, view: JobView | None) -> tuple[str | None, str | None]:
    if isinstance(p, JobRejected):
        return p.reason_code.value, p.message
    if isinstance(p, JobPreempted) and (p.work_kept_s or p.work_lost_s):
        work = f"{p.work_kept_s:g} s of work kept, {p.work_lost_s:g} s lost"
        return p.reason_code, f"{p.message} ({work})"
    if isinstance(p, JobFinished | PlacementRefused | JobPreempted | RunFailed):
        return p.reason_code, p.message
    if isinstance(p, JobCheckpointRequested):
        stop = p.stop_at.isoformat(timespec="seconds")
        return "checkpoint_requested", (
            f"asked to checkpoint to make room for job {p.for_job} ({p.reason_code}); "
            f"stopped after its {p.grace_s:g} s grace period, at {stop}"
        )
    if isinstance(p, PreemptionCanceled):
        return p.reason_code, f"not preempted: {p.message}"
    if isinstance(p, PlacementDecided):
        nodes = sorted({r.node_id for r in p.replicas})
        return None, f"placed on {p.cluster}: {', '.join(nodes)} (attempt {p.attempt})"
    if isinstance(p, JobStarted):
        return None, f"running on {len(p.nodes)} node(s) in {p.cluster}"
    if isinstance(p, JobCancelRequested):
        return "cancel_requested", f"cancel requested by {p.requested_by}"
    if isinstance(p, JobQueued):
        if p.requeue_of_attempt is not None:
            return "requeued", _requeued(p, view)
        return None, f"queued in {p.spec.queue}"
    return None, None


def _requeued(p: JobQueued, view: JobView | None) -> str:
    words = [f"requeued after attempt {p.requeue_of_attempt}"]
    if p.excluded_nodes:
        words.append(f"avoiding {', '.join(p.excluded_nodes)}")
    first = view.spec if view is not None else None
    memory = p.spec.resources.memory_gb
    if first is not None and first.resources.memory_gb != memory:
        words.append(f"with {memory:g} GB memory per replica")  # grown after out of memory
    if p.not_before is not None:
        words.append(f"not placed before {p.not_before.isoformat(timespec='seconds')}")
    return ", ".join(words)
