"""How a simulated run behaves from its labels, what its checkpoints keep, and the events that
report its end and its progress."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from schemas.events import JobFinished, ReplicaAssignment, RunFailed
from schemas.job import JobSpec
from services.executor.runs import ended_by_itself, progress, work_split
from services.executor.simulated import RunEnd, kept_work_s, simulate, step_times
from services.executor.store import Checkpoint, RunningJob

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def spec(
    labels: dict[str, str] | None = None,
    *,
    max_runtime_s: float | None = None,
    memory_gb: float = 32,
) -> JobSpec:
    return JobSpec.model_validate(
        {
            "tenant": "vision",
            "job_id": "j",
            "labels": labels or {},
            "max_runtime_s": max_runtime_s,
            "resources": {"memory_gb": memory_gb},
        }
    )


def placed(*memory_gb: float) -> list[ReplicaAssignment]:
    return [
        ReplicaAssignment(replica=i, node_id=f"n{i}", accelerators=1, cpu=1, memory_gb=gb)
        for i, gb in enumerate(memory_gb)
    ]


@pytest.mark.parametrize(
    ("labels", "attempt", "expected"),
    [
        ({"sim_duration_s": "600"}, 1, (600, RunEnd.SUCCEEDED, None, None)),
        ({}, 1, (300, RunEnd.SUCCEEDED, None, None)),  # the default duration
        ({"sim_duration_s": "soon"}, 1, (300, RunEnd.SUCCEEDED, None, None)),
        (
            {"sim_duration_s": "600", "sim_outcome": "failed"},
            3,
            (600, RunEnd.RUN_FAILED, "application_error", 1),
        ),
        (
            {"sim_duration_s": "600", "sim_fail_attempts": "2"},
            1,
            (600, RunEnd.RUN_FAILED, "application_error", 1),
        ),
        (
            {"sim_duration_s": "600", "sim_fail_attempts": "2"},
            2,
            (600, RunEnd.RUN_FAILED, "application_error", 1),
        ),
        (
            {"sim_duration_s": "600", "sim_fail_attempts": "2"},
            3,
            (600, RunEnd.SUCCEEDED, None, None),
        ),
        (
            {"sim_duration_s": "600", "sim_memory_gb": "48"},
            1,
            (60, RunEnd.RUN_FAILED, "out_of_memory", 137),
        ),
        ({"sim_duration_s": "600", "sim_memory_gb": "32"}, 1, (600, RunEnd.SUCCEEDED, None, None)),
    ],
)
def test_labels_decide_how_long_a_run_lasts_and_how_it_ends(
    labels: dict[str, str], attempt: int, expected: tuple[float, RunEnd, str | None, int | None]
) -> None:
    run = simulate(spec(labels), 300, attempt, placed(32))
    assert (run.virtual_s, run.end, run.reason_code, run.exit_code) == expected


def test_out_of_memory_names_the_replica_its_need_and_its_limit() -> None:
    run = simulate(spec({"sim_duration_s": "1000", "sim_memory_gb": "96"}), 300, 1, placed(128, 64))
    assert run.reason_code == "out_of_memory" and run.virtual_s == 100
    assert "replica 1" in run.message and "96 GB" in run.message and "64 GB" in run.message


def test_without_placed_replicas_the_spec_memory_is_the_limit() -> None:
    assert simulate(spec({"sim_memory_gb": "20"}, memory_gb=16), 300).reason_code == "out_of_memory"
    assert simulate(spec({"sim_memory_gb": "20"}, memory_gb=32), 300).end is RunEnd.SUCCEEDED


@pytest.mark.parametrize(
    ("labels", "max_runtime", "expected"),
    [
        # Runs past its max runtime: the platform ends the job (terminal), whatever came later.
        ({"sim_duration_s": "600"}, 100, (100, RunEnd.FAILED, "max_runtime_exceeded")),
        (
            {"sim_duration_s": "600", "sim_outcome": "failed"},
            100,
            (100, RunEnd.FAILED, "max_runtime_exceeded"),
        ),
        # Killed out of memory (at 60 s) before its max runtime: a run failure.
        (
            {"sim_duration_s": "600", "sim_memory_gb": "64"},
            100,
            (60, RunEnd.RUN_FAILED, "out_of_memory"),
        ),
        (
            {"sim_duration_s": "600", "sim_memory_gb": "64"},
            30,
            (30, RunEnd.FAILED, "max_runtime_exceeded"),
        ),
    ],
)
def test_whichever_end_comes_first_wins(
    labels: dict[str, str], max_runtime: float, expected: tuple[float, RunEnd, str]
) -> None:
    run = simulate(spec(labels, max_runtime_s=max_runtime), 300, 1, placed(32))
    assert (run.virtual_s, run.end, run.reason_code) == expected


def test_step_and_checkpoint_labels() -> None:
    run = simulate(
        spec({"sim_step_s": "0.5", "sim_checkpoint_s": "20", "sim_checkpoint_every_s": "900"}), 300
    )
    assert (run.step_s, run.checkpoint_s, run.checkpoint_every_s) == (0.5, 20, 900)
    plain = simulate(spec(), 300)
    assert (plain.step_s, plain.checkpoint_s, plain.checkpoint_every_s) == (1.0, 10.0, None)
    assert simulate(spec({"sim_checkpoint_every_s": "0"}), 300).checkpoint_every_s is None


@pytest.mark.parametrize(
    ("ran", "every", "requested", "kept"),
    [
        (500, None, None, 0),
        (500, 100, None, 400),  # checkpoints start at 100..400 and take 10 s each
        (405, 100, None, 300),  # the one started at 400 is still being written
        (410, 100, None, 400),
        (50, 100, None, 0),
        (500, None, (250, 260), 250),  # the signalled one saves the state of its start
        (255, None, (250, 260), 0),  # ... once it has completed
        (500, 100, (450, 460), 450),
        (500, 100, (150, 160), 400),  # the latest completed checkpoint counts
    ],
)
def test_kept_work_is_the_latest_completed_checkpoint(
    ran: float, every: float | None, requested: tuple[float, float] | None, kept: float
) -> None:
    assert kept_work_s(ran, checkpoint_s=10, every_s=every, requested=requested) == kept


def job(
    replicas: list[ReplicaAssignment] | None = None,
    end: RunEnd = RunEnd.SUCCEEDED,
    checkpoint: Checkpoint | None = None,
    **kw: object,
) -> RunningJob:
    return RunningJob(
        job_id="j",
        attempt=2,
        epoch=1,
        tenant="vision",
        replicas=replicas or placed(32),
        started_at=T0,
        ends_at=T0 + timedelta(seconds=10),
        end=end,
        checkpoint=checkpoint,
        **kw,  # type: ignore[arg-type]
    )


def test_work_split_in_fleet_seconds() -> None:
    signalled = Checkpoint(T0 + timedelta(seconds=1), T0 + timedelta(seconds=1.1))
    ran, kept, lost = work_split(job(checkpoint=signalled), T0 + timedelta(seconds=2), 600)
    assert (ran, kept, lost) == (1200, 600, 600)
    # Not yet written when the run is stopped: nothing kept.
    slow = Checkpoint(T0 + timedelta(seconds=1), T0 + timedelta(seconds=3))
    assert work_split(job(checkpoint=slow), T0 + timedelta(seconds=2), 600) == (1200, 0, 1200)


def test_a_job_failure_is_a_run_failure_and_the_rest_end_the_job() -> None:
    failed = ended_by_itself(
        job(end=RunEnd.RUN_FAILED, reason_code="out_of_memory", message="m", exit_code=137),
        "c",
        60,
    )
    assert isinstance(failed, RunFailed)
    assert (failed.reason_code, failed.exit_code, failed.ran_s, failed.attempt) == (
        "out_of_memory",
        137,
        600,
        2,
    )
    for end in (RunEnd.SUCCEEDED, RunEnd.FAILED):
        done = ended_by_itself(job(end=end), "c", 60)
        assert isinstance(done, JobFinished) and done.outcome.value == end.value


def test_progress_reports_gangs_only_and_shows_the_straggler() -> None:
    rng = random.Random(1)
    assert progress(job(), "c", {}, rng) is None
    gang = job(replicas=placed(32, 32, 32), step_s=2.0)
    report = progress(gang, "c", {"n1": 4.0}, rng)
    assert report is not None
    steps = [r.step_time_s for r in report.replicas]
    assert [r.node_id for r in report.replicas] == ["n0", "n1", "n2"]
    assert all(1.96 <= s <= 2.04 for s in (steps[0], steps[2]))
    assert 7.84 <= steps[1] <= 8.16


def test_step_noise_repeats_with_the_seed() -> None:
    nodes = ["a", "b", "c"]
    assert step_times(1.0, nodes, {}, random.Random(7)) == step_times(
        1.0, nodes, {}, random.Random(7)
    )
