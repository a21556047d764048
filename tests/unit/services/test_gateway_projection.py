"""The gateway's read model folds events in any order to the right state."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest

from schemas.events import (
    JobCheckpointRequested,
    JobFinished,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobStarted,
    Outcome,
    PlacementDecided,
    PlacementRefused,
    PreemptionCanceled,
    RejectReason,
    ReplicaAssignment,
    RunFailed,
)
from schemas.job import JobState
from services.gateway.projection import project
from tests.unit.services.builders import T0, event, spec


def lifecycle() -> list[tuple[str, object]]:
    s = spec(job_id="j1")
    return [
        ("JobQueued", JobQueued(job_id="j1", spec=s, submitted_at=T0)),
        (
            "PlacementDecided",
            PlacementDecided(
                job_id="j1",
                attempt=1,
                epoch=1,
                leader="x",
                cluster="c",
                accelerator_type="H100",
                spec=s,
                replicas=[
                    ReplicaAssignment(replica=0, node_id="n", accelerators=1, cpu=1, memory_gb=1)
                ],
            ),
        ),
        ("JobStarted", JobStarted(job_id="j1", attempt=1, cluster="c", nodes=["n"], started_at=T0)),
        ("JobFinished", JobFinished(job_id="j1", attempt=1, outcome=Outcome.SUCCEEDED)),
    ]


@pytest.mark.parametrize("order", list(itertools.permutations(range(1, 4))))
def test_any_arrival_order_ends_succeeded(order: tuple[int, ...]) -> None:
    events = lifecycle()
    view = None
    for i, idx in enumerate((0, *order)):
        kind, payload = events[idx]
        view, line = project(view, event(kind, payload, T0 + timedelta(seconds=i)), payload)
        assert line.job_id == "j1"
    assert view is not None and view.state is JobState.SUCCEEDED


def test_lifecycle_of_an_unknown_job_is_not_invented() -> None:
    _, payload = lifecycle()[2]
    view, line = project(None, event("JobStarted", payload), payload)
    assert view is None and line.state is None


def test_rejection_carries_reason_and_message() -> None:
    rej = JobRejected(job_id="j9", reason_code=RejectReason.UNKNOWN_QUEUE, message="no queue")
    env = event("JobRejected", rej).model_copy(update={"tenant": "vision"})
    view, line = project(None, env, rej)
    assert view is not None and view.state is JobState.REJECTED and view.tenant == "vision"
    assert (line.reason_code, line.message) == ("unknown_queue", "no queue")


def run_failed(attempt: int = 1) -> RunFailed:
    return RunFailed(
        job_id="j1",
        attempt=attempt,
        cluster="c",
        reason_code="application_error",
        message="the job's process exited with code 1",
        exit_code=1,
    )


def fold(*events: tuple[str, object]) -> tuple[object, list[object]]:
    view, lines = None, []
    for i, (kind, payload) in enumerate(events):
        view, line = project(view, event(kind, payload, T0 + timedelta(seconds=i)), payload)
        lines.append(line)
    return view, lines


def test_a_failed_run_is_in_the_history_and_the_queue_decides_the_state() -> None:
    queued, placed, started, _ = lifecycle()
    view, lines = fold(queued, placed, started, ("RunFailed", run_failed()))
    assert view is not None and view.state is JobState.RUNNING  # retry or end: not yet known
    line = lines[-1]
    assert (line.type, line.reason_code) == ("RunFailed", "application_error")
    assert line.message == "the job's process exited with code 1"
    # The queue retries it: back to queued, the retry's wait and grown memory in the history.
    grown = spec(job_id="j1", resources={"memory_gb": 48})
    retry = JobQueued(
        job_id="j1",
        spec=grown,
        submitted_at=T0,
        attempt=1,
        requeue_of_attempt=1,
        not_before=T0 + timedelta(seconds=30),
    )
    view, lines = fold(queued, placed, started, ("RunFailed", run_failed()), ("JobQueued", retry))
    assert view is not None and view.state is JobState.QUEUED and view.ended_attempt == 1
    assert lines[-1].message == (
        "requeued after attempt 1, with 48 GB memory per replica, "
        "not placed before 2026-01-01T00:00:30+00:00"
    )


def test_a_failed_run_then_the_queue_ending_the_job_leaves_it_failed() -> None:
    queued, placed, started, _ = lifecycle()
    end = JobFinished(
        job_id="j1",
        outcome=Outcome.FAILED,
        reason_code="application_error",
        message="failed 3 times",
    )
    late_start = ("JobStarted", started[1])
    view, _ = fold(queued, placed, started, ("RunFailed", run_failed()), ("JobFinished", end))
    assert view is not None and view.state is JobState.FAILED
    assert view.reason_code == "application_error"
    view2, _ = fold(queued, placed, ("RunFailed", run_failed()), late_start, ("JobFinished", end))
    assert view2 is not None and view2.state is JobState.FAILED


def test_late_events_of_a_failed_run_do_not_revive_it() -> None:
    queued, placed, started, _ = lifecycle()
    # The failure is read before the run's placement and start (other topics).
    view, _ = fold(queued, ("RunFailed", run_failed()), placed, started)
    assert view is not None and view.state is JobState.QUEUED and view.ended_attempt == 1


def test_a_stale_failure_changes_nothing() -> None:
    queued, placed, started, _ = lifecycle()
    view, _ = fold(queued, placed, started)
    assert view is not None
    stale = run_failed(attempt=0)
    after, line = project(view, event("RunFailed", stale), stale)  # type: ignore[arg-type]
    assert after == view and line.reason_code == "application_error"


def test_a_preemption_line_says_how_much_work_was_kept() -> None:
    p = JobPreempted(
        job_id="j1",
        attempt=1,
        cluster="c",
        reason_code="preempted_for_priority",
        message="made room for j9",
        work_kept_s=540,
        work_lost_s=60,
        for_job="j9",
    )
    _, lines = fold(*lifecycle()[:3], ("JobPreempted", p))
    assert lines[-1].message == "made room for j9 (540 s of work kept, 60 s lost)"  # type: ignore[attr-defined]


def checkpoint(attempt: int = 1) -> JobCheckpointRequested:
    return JobCheckpointRequested(
        job_id="j1",
        attempt=attempt,
        cluster="c",
        grace_s=120,
        stop_at=T0 + timedelta(seconds=2),
        for_job="j9",
        reason_code="preempted_for_priority",
    )


def test_a_run_asked_to_checkpoint_shows_preempting_until_it_is_requeued() -> None:
    queued, placed, started, _ = lifecycle()
    view, lines = fold(queued, placed, started, ("JobCheckpointRequested", checkpoint()))
    assert view is not None and view.state is JobState.PREEMPTING  # type: ignore[attr-defined]
    assert lines[-1].reason_code == "checkpoint_requested"  # type: ignore[attr-defined]
    assert "room for job j9" in lines[-1].message  # type: ignore[attr-defined]
    ended = JobPreempted(
        job_id="j1", attempt=1, cluster="c", reason_code="preempted_for_priority", message="m"
    )
    view, _ = fold(
        queued, placed, started, ("JobCheckpointRequested", checkpoint()), ("JobPreempted", ended)
    )
    assert view is not None and view.state is JobState.QUEUED  # type: ignore[attr-defined]


def test_a_called_off_preemption_returns_the_run_to_running() -> None:
    queued, placed, started, _ = lifecycle()
    off = PreemptionCanceled(
        job_id="j1", attempt=1, for_job="j9", reason_code="requester_gone", message="j9 ended"
    )
    view, lines = fold(
        queued,
        placed,
        started,
        ("JobCheckpointRequested", checkpoint()),
        ("PreemptionCanceled", off),
    )
    assert view is not None and view.state is JobState.RUNNING  # type: ignore[attr-defined]
    assert (lines[-1].reason_code, lines[-1].message) == (  # type: ignore[attr-defined]
        "requester_gone",
        "not preempted: j9 ended",
    )
    # A signal for an older run changes nothing.
    view, _ = fold(queued, placed, started, ("JobCheckpointRequested", checkpoint(attempt=0)))
    assert view is not None and view.state is JobState.RUNNING  # type: ignore[attr-defined]


def test_a_deposed_leaders_refused_copy_leaves_the_job_placed() -> None:
    events = lifecycle()[:2]
    stale = PlacementRefused(
        job_id="j1", attempt=1, epoch=0, cluster="c", reason_code="stale_epoch", message="old"
    )
    view = None
    for i, (kind, payload) in enumerate([*events, ("PlacementRefused", stale)]):
        view, _ = project(view, event(kind, payload, T0 + timedelta(seconds=i)), payload)
    assert view is not None and view.state is JobState.PLACED
