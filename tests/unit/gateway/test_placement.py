"""The read model keeps where each attempt was placed (replica by replica, device by device),
the type to group a job by, and the job each preemption made room for."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from schemas.events import (
    JobCheckpointRequested,
    JobPreempted,
    JobQueued,
    JobStarted,
    PlacementDecided,
    ReplicaAssignment,
)
from schemas.job import JobState
from services.gateway.projection import JobView, Placement, project, wanted_type
from tests.unit.services.builders import T0, event, spec

SPEC = spec(
    job_id="j1", replicas=2, resources={"accelerators": 4, "accelerator_types": ["H100", "A100"]}
)


def placed(attempt: int = 1, type: str = "H100", devices: bool = True) -> PlacementDecided:
    return PlacementDecided(
        job_id="j1",
        attempt=attempt,
        epoch=1,
        leader="s",
        cluster="c1",
        accelerator_type=type,
        spec=SPEC,
        replicas=[
            ReplicaAssignment(
                replica=i,
                node_id=f"n{i}",
                accelerators=4,
                cpu=8,
                memory_gb=64,
                devices=[4 * attempt + d for d in range(4)] if devices else [],
            )
            for i in range(2)
        ],
    )


def started(attempt: int = 1) -> JobStarted:
    return JobStarted(job_id="j1", attempt=attempt, cluster="c1", nodes=["n0", "n1"], started_at=T0)


def fold(*payloads: Any) -> JobView:
    view: JobView | None = None
    for i, p in enumerate(payloads):
        view, _ = project(view, event(type(p).__name__, p, T0 + timedelta(seconds=i)), p)
    assert view is not None
    return view


QUEUED = JobQueued(job_id="j1", spec=SPEC, submitted_at=T0)


def test_a_placed_job_holds_the_named_devices_of_its_attempt() -> None:
    view = fold(QUEUED, placed())
    assert view.state is JobState.PLACED and view.held is not None
    assert [(r.node_id, r.devices) for r in view.held.replicas] == [
        ("n0", (4, 5, 6, 7)),
        ("n1", (4, 5, 6, 7)),
    ]
    assert view.accelerator_type == "H100"


def test_a_start_that_came_first_still_gets_its_placement() -> None:
    view = fold(QUEUED, started(), placed())
    assert view.state is JobState.RUNNING
    assert view.held is not None and view.held.attempt == 1


def test_a_requeued_job_holds_nothing_and_is_grouped_by_what_it_asks_for() -> None:
    preempted = JobPreempted(
        job_id="j1", attempt=1, cluster="c1", reason_code="preempted_for_priority",
        message="room for j2", for_job="j2",
    )  # fmt: skip
    view = fold(QUEUED, placed(), started(), preempted)
    assert view.state is JobState.QUEUED and view.held is None
    assert view.accelerator_type == "A100|H100"
    again = fold(QUEUED, placed(), started(), preempted, placed(attempt=2, type="A100"))
    assert again.held is not None and again.held.replicas[0].devices == (8, 9, 10, 11)
    assert again.accelerator_type == "A100"


def test_late_events_of_an_earlier_attempt_change_nothing() -> None:
    running = (QUEUED, placed(attempt=2), started(attempt=2))
    late_placement = fold(*running, placed(attempt=1))
    assert late_placement.held is not None and late_placement.held.attempt == 2
    preempted = JobPreempted(job_id="j1", attempt=1, cluster="c1", reason_code="x", message="m")
    late_preemption = fold(*running, preempted)
    assert late_preemption.held is not None and late_preemption.held.replicas[0].devices == (
        8, 9, 10, 11,
    )  # fmt: skip


def test_a_placement_naming_no_devices_keeps_the_amounts() -> None:
    view = fold(QUEUED, placed(devices=False))
    assert view.held is not None
    assert [(r.accelerators, r.devices) for r in view.held.replicas] == [(4, ()), (4, ())]


def test_a_placement_survives_its_json_column() -> None:
    view = fold(QUEUED, placed())
    assert view.placement is not None
    assert Placement.from_json(view.placement.as_json()) == view.placement


@pytest.mark.parametrize(
    ("payload", "for_job"),
    [
        (
            JobCheckpointRequested(
                job_id="j1", attempt=1, cluster="c1", grace_s=30, stop_at=T0, for_job="j7",
                reason_code="preempted_for_priority",
            ),
            "j7",
        ),
        (
            JobPreempted(
                job_id="j1", attempt=1, cluster="c1", reason_code="r", message="m", for_job="j8"
            ),
            "j8",
        ),
        (
            JobPreempted(
                job_id="j1", attempt=1, cluster="c1", reason_code="node_failure", message="m",
                failed_nodes=["n0"],
            ),
            None,
        ),
        (started(), None),
    ],
)  # fmt: skip
def test_the_history_line_names_the_job_a_preemption_made_room_for(
    payload: Any, for_job: str | None
) -> None:
    view = fold(QUEUED, placed())
    _, line = project(view, event(type(payload).__name__, payload), payload)
    assert line.for_job == for_job


@pytest.mark.parametrize(
    ("types", "expected"),
    [((), "any"), (("H100",), "H100"), (("TPU-v5e", "A100", "A100"), "A100|TPU-v5e")],
)
def test_wanted_type(types: tuple[str, ...], expected: str) -> None:
    assert wanted_type(spec(resources={"accelerator_types": types})) == expected
