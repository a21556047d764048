"""The gateway's read model folds events in any order to the right state."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest

from schemas.events import (
    JobFinished,
    JobQueued,
    JobRejected,
    JobStarted,
    Outcome,
    PlacementDecided,
    RejectReason,
    ReplicaAssignment,
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
