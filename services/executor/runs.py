"""A running job seen from outside: its fleet-time accounting (how long it ran, how much work
its checkpoints kept) and the events that report it — how it ended, or how fast it steps."""

from __future__ import annotations

import random
from collections.abc import Mapping
from datetime import datetime

from schemas.events import (
    JobFinished,
    JobPreempted,
    JobProgress,
    Outcome,
    ReplicaProgress,
    RunFailed,
)
from services.executor.simulated import RunEnd, kept_work_s, step_times
from services.executor.store import RunningJob


def fleet_s(since: datetime, until: datetime, time_scale: float) -> float:
    """Fleet seconds between two wall-clock moments."""
    return (until - since).total_seconds() * time_scale


def work_split(job: RunningJob, now: datetime, time_scale: float) -> tuple[float, float, float]:
    """(ran, kept, lost) fleet seconds of a run stopped at `now`: what its completed
    checkpoints (periodic, or the one it was signalled to take) saved, and what is to redo."""
    ran = max(fleet_s(job.started_at, now, time_scale), 0.0)
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
    ran = round(fleet_s(job.started_at, job.ends_at, time_scale), 3)
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
