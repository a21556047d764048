"""The seam between the executor's decisions and its backends: what a backend makes of an
accepted placement, and how a run a backend saw end is announced."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from schemas import topics
from schemas.events import PlacementDecided, ReplicaAssignment
from schemas.job import JobSpec
from services.executor.backend import (
    NEVER,
    ReportKind,
    RunReport,
    SimulatedBackend,
    open_run,
)
from services.executor.runs import reported_end
from services.executor.simulated import RunEnd

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def placement(**labels: str) -> PlacementDecided:
    return PlacementDecided(
        job_id="j",
        attempt=3,
        epoch=5,
        leader="l",
        cluster="c",
        accelerator_type="H100",
        spec=JobSpec(tenant="vision", job_id="j", labels=labels),
        replicas=[ReplicaAssignment(replica=0, node_id="n", accelerators=1, cpu=1, memory_gb=1)],
    )


def test_the_simulated_backend_starts_runs_at_once_on_their_clock() -> None:
    job = SimulatedBackend(time_scale=60, default_duration_s=300).begin(
        placement(sim_duration_s="600"), T0
    )
    assert job.started and job.end is RunEnd.SUCCEEDED
    assert job.ends_at == T0 + timedelta(seconds=10)
    assert (job.job_id, job.attempt, job.epoch, job.tenant) == ("j", 3, 5, "vision")


def test_a_run_a_backend_reports_is_not_started_and_never_due() -> None:
    job = open_run(placement(), T0)
    assert not job.started and job.ends_at == T0 + NEVER


@pytest.mark.parametrize(
    ("kind", "reason", "topic", "how", "grace"),
    [
        (ReportKind.SUCCEEDED, None, topics.JOB_FINISHED, "succeeded", None),
        (ReportKind.FAILED, "out_of_memory", topics.JOB_RUN_FAILED, "run_failed", None),
        (ReportKind.FAILED, "max_runtime_exceeded", topics.JOB_FINISHED, "failed", None),
        (ReportKind.REFUSED, "unschedulable", topics.PLACEMENT_REFUSED, "refused", 0),
        (ReportKind.LOST, "pods_lost", topics.JOB_PREEMPTED, "lost", 0),
    ],
)
def test_a_reported_end_is_announced(
    kind: ReportKind, reason: str | None, topic: str, how: str, grace: int | None
) -> None:
    job = open_run(placement(), T0)
    job.started = kind is not ReportKind.REFUSED
    r = RunReport("j", 3, kind, reason, "what happened", 137, ("n",))
    end = reported_end(job, r, "c", T0 + timedelta(seconds=90), time_scale=1)
    assert (end.topic, end.how, end.grace_s) == (topic, how, grace)
    payload = end.payload.model_dump()
    assert payload["job_id"] == "j" and payload["attempt"] == 3
    if topic == topics.JOB_RUN_FAILED:
        assert payload["reason_code"] == "out_of_memory" and payload["exit_code"] == 137
        assert payload["ran_s"] == 90
    if topic == topics.PLACEMENT_REFUSED:
        assert payload["epoch"] == 5 and payload["message"] == "what happened"
