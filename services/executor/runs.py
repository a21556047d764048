"""A running job seen from outside: its fleet-time accounting (how long it ran, how much work
its checkpoints kept) and the events that report it — how it ended, or how fast it steps."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from schemas import topics
from schemas.bounds import MAX_RUN_S
from schemas.events import (
    JobFinished,
    JobPreempted,
    JobProgress,
    Outcome,
    Payload,
    PlacementRefused,
    ReplicaProgress,
    RunFailed,
)
from schemas.serving import ReplicaReported
from services.executor.backend import ReportKind, RunReport
from services.executor.simulated import RunEnd, kept_work_s, step_times
from services.executor.store import RunningJob


def fleet_s(since: datetime, until: datetime, time_scale: float) -> float:
    """Fleet seconds between two wall-clock moments."""
    return (until - since).total_seconds() * time_scale


def run_seconds(since: datetime, until: datetime, time_scale: float) -> float:
    """A run's fleet seconds as its end event reports them: never negative (a clock stepped
    back), never past what the wire takes (MAX_RUN_S: a served model running for months at a
    dev time scale), so that building the event cannot fail."""
    return round(min(max(fleet_s(since, until, time_scale), 0.0), MAX_RUN_S), 3)


def work_split(job: RunningJob, now: datetime, time_scale: float) -> tuple[float, float, float]:
    """(ran, kept, lost) fleet seconds of a run stopped at `now`: what its completed
    checkpoints (periodic, or the one it was signalled to take) saved, and what is to redo."""
    ran = min(max(fleet_s(job.started_at, now, time_scale), 0.0), MAX_RUN_S)
    requested = None
    if job.checkpoint is not None:
        c = job.checkpoint
        requested = (
            fleet_s(job.started_at, c.at, time_scale),
            fleet_s(job.started_at, c.done_at, time_scale),
        )
    kept = kept_work_s(
        ran, checkpoint_s=job.checkpoint_s, every_s=job.checkpoint_every_s, requested=requested
    )
    return round(ran, 3), round(kept, 3), round(ran - kept, 3)


def preempted(
    job: RunningJob,
    cluster: str,
    now: datetime,
    time_scale: float,
    *,
    reason_code: str,
    message: str,
    failed_nodes: list[str] | None = None,
    for_job: str | None = None,
) -> JobPreempted:
    """The platform took this run away (a node failed, a higher claim needed the room)."""
    ran, kept, lost = work_split(job, now, time_scale)
    return JobPreempted(
        job_id=job.job_id,
        attempt=job.attempt,
        cluster=cluster,
        reason_code=reason_code,
        message=message,
        failed_nodes=failed_nodes or [],
        ran_s=ran,
        work_kept_s=kept,
        work_lost_s=lost,
        for_job=for_job,
    )


def ended_by_itself(job: RunningJob, cluster: str, time_scale: float) -> JobFinished | RunFailed:
    """The event for a run that reached its own end: a job failure is a (retryable) run
    failure; success and running out of max runtime end the job."""
    ran = run_seconds(job.started_at, job.ends_at, time_scale)
    if job.end is RunEnd.RUN_FAILED:
        return RunFailed(
            job_id=job.job_id,
            attempt=job.attempt,
            cluster=cluster,
            reason_code=job.reason_code or "application_error",
            message=job.message or "the job failed",
            exit_code=job.exit_code,
            ran_s=ran,
        )
    return JobFinished(
        job_id=job.job_id,
        attempt=job.attempt,
        outcome=Outcome(job.end.value),
        reason_code=job.reason_code,
        message=job.message,
        cluster=cluster,
        ran_s=ran,
    )


def progress(
    job: RunningJob, cluster: str, slowdown: Mapping[str, float], rng: random.Random
) -> JobProgress | None:
    """Step times of each replica of a gang; None for a single replica (it has no peers to
    straggle behind)."""
    if len(job.replicas) < 2:
        return None
    replicas = sorted(job.replicas, key=lambda r: r.replica)
    times = step_times(job.step_s, [r.node_id for r in replicas], slowdown, rng)
    return JobProgress(
        job_id=job.job_id,
        attempt=job.attempt,
        cluster=cluster,
        replicas=[
            ReplicaProgress(replica=r.replica, node_id=r.node_id, step_time_s=t)
            for r, t in zip(replicas, times, strict=True)
        ],
    )


SERVICE_PORT = 8000  # where a simulated replica answers on its node


def readiness(job: RunningJob, cluster: str, now: datetime) -> ReplicaReported | None:
    """A service replica runs, and is ready once it has loaded its model, and where (the
    simulated fleet plays the replica's agent and readiness probe); None for other runs."""
    if job.service is None or job.ready_at is None or not job.replicas:
        return None
    node = job.replicas[0].node_id
    return ReplicaReported(
        service=job.service,
        replica=job.job_id,
        attempt=job.attempt,
        ready=job.ready_at <= now,
        address=f"{node}.{cluster}:{SERVICE_PORT}",
        cluster=cluster,
        node=node,
    )


@dataclass(frozen=True)
class ReportedEnd:
    """How a run a backend saw end is announced, and how what is left of it is torn down."""

    topic: str
    event_type: str
    payload: Payload
    how: str  # for the metrics and the teardown
    grace_s: int | None  # None: the grace the job was granted


# Failures reported by a backend that end the job instead of being retried: the max runtime
# ran out, or the job as specified cannot run on the cluster (the API refused its pod).
FINAL_FAILURES = frozenset({"max_runtime_exceeded", "invalid_pod"})


def reported_end(
    job: RunningJob, r: RunReport, cluster: str, now: datetime, time_scale: float
) -> ReportedEnd:
    """A run that never started is refused back to the scheduler; one whose workload vanished
    is handed back; a job failure is a (retryable) run failure, unless it is final (its max
    runtime ran out, or its pod is invalid); success ends the job."""
    ran = run_seconds(job.started_at, now, time_scale) if job.started else 0.0
    if r.kind is ReportKind.REFUSED:
        refusal = PlacementRefused(
            job_id=job.job_id,
            attempt=job.attempt,
            epoch=job.epoch,
            cluster=cluster,
            reason_code=r.reason_code or "refused",
            message=r.message,
        )
        return ReportedEnd(topics.PLACEMENT_REFUSED, "PlacementRefused", refusal, "refused", 0)
    if r.kind is ReportKind.LOST:
        lost = preempted(
            job,
            cluster,
            now,
            time_scale,
            reason_code=r.reason_code or "pods_lost",
            message=r.message,
            failed_nodes=list(r.nodes),
        )
        return ReportedEnd(topics.JOB_PREEMPTED, "JobPreempted", lost, "lost", 0)
    if r.kind is ReportKind.FAILED and r.reason_code not in FINAL_FAILURES:
        failed = RunFailed(
            job_id=job.job_id,
            attempt=job.attempt,
            cluster=cluster,
            reason_code=r.reason_code or "application_error",
            message=r.message,
            exit_code=r.exit_code,
            ran_s=ran,
        )
        return ReportedEnd(topics.JOB_RUN_FAILED, "RunFailed", failed, "run_failed", None)
    outcome = Outcome.SUCCEEDED if r.kind is ReportKind.SUCCEEDED else Outcome.FAILED
    done = JobFinished(
        job_id=job.job_id,
        attempt=job.attempt,
        outcome=outcome,
        reason_code=r.reason_code,
        message=r.message or None,
        cluster=cluster,
        ran_s=ran,
    )
    return ReportedEnd(topics.JOB_FINISHED, "JobFinished", done, outcome.value, None)
