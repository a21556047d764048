"""Retries by failure class and requeue backoff, as the queue's pure state machine decides
them (services.queue.retries, through plan_batch where the batch matters)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobCancelRequested,
    JobFinished,
    JobPreempted,
    JobStarted,
    Outcome,
    RunFailed,
)
from schemas.job import JobSpec, JobState
from services.queue.intake import LifecycleEvent
from services.queue.lifecycle import JobRecord, Step
from services.queue.planning import plan_batch
from services.queue.retries import Backoff, on_preempted, on_run_failed
from tests.unit.services.builders import T0, event, policy, spec

FAILED_AT = T0 + timedelta(hours=1)
SCALE = 60.0  # fleet seconds per wall second: 30 fleet s = 0.5 wall s
BACKOFF = Backoff(claim_base_s=30, claim_cap_s=900, time_scale=SCALE)


def job(**retry: Any) -> JobSpec:
    return spec(job_id="j1", retry=retry) if retry else spec(job_id="j1")


def running(attempt: int = 1, **fields: Any) -> JobRecord:
    rec = JobRecord("j1", "vision", JobState.RUNNING, T0, T0, attempt=attempt, cluster="c1")
    return replace(rec, **fields)


def failed(
    attempt: int = 1, reason: str = "application_error", at_s: float = 0
) -> tuple[RunFailed, Envelope]:
    p = RunFailed(
        job_id="j1",
        attempt=attempt,
        cluster="c1",
        reason_code=reason,
        message="the job's process exited with code 1",
        exit_code=1,
        ran_s=120,
    )
    return p, event("RunFailed", p, FAILED_AT + timedelta(seconds=at_s))


def preempted(
    attempt: int = 1, reason: str = "preempted_for_priority", **fields: Any
) -> tuple[JobPreempted, Envelope]:
    p = JobPreempted(
        job_id="j1",
        attempt=attempt,
        cluster="c1",
        reason_code=reason,
        message=f"preempted ({reason})",
        **fields,
    )
    return p, event("JobPreempted", p, FAILED_AT)


def emitted(step: Step) -> list[tuple[str, dict[str, Any]]]:
    return [(m.topic, m.envelope.payload) for m in step.emits]


def wall(fleet_s: float) -> timedelta:
    return timedelta(seconds=fleet_s / SCALE)


def queued_not_before(payload: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(payload["not_before"])


def submitted_at(payload: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(payload["submitted_at"])


# --- application errors: retried with a doubling backoff, then the job fails -------------


def test_first_application_error_is_retried_after_the_backoff() -> None:
    rec = running(excluded_nodes=("bad-node",), requeues=1)
    step = on_run_failed(rec, *failed(), job(), BACKOFF)
    assert step.record.state is JobState.QUEUED
    assert (step.record.failures, step.record.requeues) == (1, 2)
    assert (step.record.attempt, step.record.ended_attempt) == (1, 1)
    [(topic, queued)] = emitted(step)
    assert topic == topics.JOB_QUEUED
    assert queued["attempt"] == 2 and queued["requeue_of_attempt"] == 1
    assert submitted_at(queued) == T0  # the original
    assert queued["excluded_nodes"] == ["bad-node"]  # kept
    assert queued_not_before(queued) == FAILED_AT + wall(30)
    [line] = step.history
    assert line.reason_code == "application_error" and line.state is JobState.QUEUED
    assert line.message == "the job's process exited with code 1; retry 1 of 2 in 30 s"


def test_each_retry_waits_twice_as_long_and_then_the_job_fails() -> None:
    spec_ = job(max_retries=2, backoff_s=30)
    rec = running()
    waits: list[timedelta] = []
    for attempt in (1, 2):
        step = on_run_failed(rec, *failed(attempt), spec_, BACKOFF)
        queued = step.emits[0].envelope.payload
        waits.append(queued_not_before(queued) - FAILED_AT)
        rec = replace(step.record, state=JobState.RUNNING, attempt=attempt + 1)
    assert waits == [wall(30), wall(60)]
    assert step.history[0].message.endswith("retry 2 of 2 in 60 s")

    last = on_run_failed(rec, *failed(3), spec_, BACKOFF)
    assert last.record.state is JobState.FAILED and last.record.failures == 3
    assert last.record.reason_code == "application_error"
    [(topic, done)] = emitted(last)
    assert topic == topics.JOB_FINISHED
    assert (done["outcome"], done["reason_code"], done.get("attempt")) == (
        "failed",
        "application_error",
        None,  # the queue ends the job, not a run
    )
    assert "failed 3 times (last on attempt 3)" in done["message"]
    assert "retry.max_retries = 2" in done["message"]


def test_no_retries_means_the_first_failure_ends_the_job() -> None:
    step = on_run_failed(running(), *failed(), job(max_retries=0), BACKOFF)
    assert step.record.state is JobState.FAILED
    assert "failed once" in (step.record.message or "")
    assert [t for t, _ in emitted(step)] == [topics.JOB_FINISHED]


def test_a_failure_reason_the_queue_does_not_know_is_charged_like_an_application_error() -> None:
    step = on_run_failed(running(), *failed(reason="segfault"), job(), BACKOFF)
    assert step.record.failures == 1 and step.record.state is JobState.QUEUED
    ended = on_run_failed(running(failures=2), *failed(reason="segfault"), job(), BACKOFF)
    assert ended.record.state is JobState.FAILED and ended.record.reason_code == "segfault"


def test_the_backoff_is_fleet_seconds_turned_into_wall_time() -> None:
    fast = Backoff(time_scale=600)
    step = on_run_failed(running(), *failed(), job(backoff_s=120), fast)
    assert queued_not_before(step.emits[0].envelope.payload) - FAILED_AT == timedelta(seconds=0.2)
    real = Backoff(time_scale=1)
    step = on_run_failed(running(), *failed(), job(backoff_s=120), real)
    assert queued_not_before(step.emits[0].envelope.payload) - FAILED_AT == timedelta(seconds=120)


def test_a_zero_backoff_requeues_without_not_before() -> None:
    step = on_run_failed(running(), *failed(), job(backoff_s=0), BACKOFF)
    assert step.emits[0].envelope.payload.get("not_before") is None


def test_time_scale_must_be_positive() -> None:
    with pytest.raises(ValueError, match="time_scale"):
        Backoff(time_scale=0)


# --- out of memory: retried only with more memory -----------------------------------------


def test_out_of_memory_with_a_factor_is_retried_with_more_memory() -> None:
    original = job(oom_memory_factor=1.5)
    assert original.resources.memory_gb == 32
    step = on_run_failed(running(), *failed(reason="out_of_memory"), original, BACKOFF)
    assert step.record.state is JobState.QUEUED and step.record.failures == 1
    [(topic, queued)] = emitted(step)
    assert topic == topics.JOB_QUEUED
    assert queued["spec"]["resources"]["memory_gb"] == 48
    assert queued_not_before(queued) - FAILED_AT == wall(30)
    assert step.spec is not None and step.spec.resources.memory_gb == 48  # to persist
    assert "retry 1 of 2 in 30 s with 48 GB memory per replica (was 32 GB)" in (
        step.history[0].message or ""
    )


def test_out_of_memory_without_a_factor_fails_at_once_saying_what_to_change() -> None:
    step = on_run_failed(running(), *failed(reason="out_of_memory"), job(), BACKOFF)
    assert step.record.state is JobState.FAILED and step.spec is None
    [(topic, done)] = emitted(step)
    assert topic == topics.JOB_FINISHED
    assert (done["outcome"], done["reason_code"]) == ("failed", "out_of_memory")
    assert "raise resources.memory_gb" in done["message"]
    assert "set retry.oom_memory_factor" in done["message"]
    assert "32 GB per replica" in done["message"]


def test_out_of_memory_with_no_retry_left_fails() -> None:
    rec = running(failures=2)
    step = on_run_failed(rec, *failed(reason="out_of_memory"), job(oom_memory_factor=2), BACKOFF)
    assert step.record.state is JobState.FAILED and step.record.reason_code == "out_of_memory"
    assert "raise resources.memory_gb" in (step.record.message or "")


def test_a_grown_spec_is_kept_for_the_next_requeue_and_for_the_store() -> None:
    """OOM then, in the same batch, the next run preempted by a node failure: the requeue
    carries the grown spec; the plan hands it to the store."""
    rec = running()
    oom_p, oom_env = failed(reason="out_of_memory")
    node_p, node_env = preempted(attempt=2, reason="node_failure", failed_nodes=["n7"])
    plan = plan_batch(
        [LifecycleEvent(oom_env, oom_p), LifecycleEvent(node_env, node_p)],
        {"j1": rec},
        {},
        policy(),
        specs={"j1": job(oom_memory_factor=2)},
        time_scale=SCALE,
    )
    memories = [m.envelope.payload["spec"]["resources"]["memory_gb"] for m in plan.emits]
    assert memories == [64, 64]
    assert plan.spec_updates["j1"].resources.memory_gb == 64
    assert plan.updates["j1"].failures == 1 and plan.updates["j1"].requeues == 2


# --- cancels and stale events ------------------------------------------------------------


def test_a_cancel_asked_during_the_run_wins_over_a_retry() -> None:
    step = on_run_failed(running(cancel_requested=True), *failed(), job(), BACKOFF)
    assert step.record.state is JobState.CANCELED
    [(topic, done)] = emitted(step)
    assert topic == topics.JOB_FINISHED and done["outcome"] == "canceled"


def test_a_cancel_during_the_backoff_ends_the_job_canceled() -> None:
    requeued = on_run_failed(running(), *failed(), job(), BACKOFF).record
    cancel = JobCancelRequested(job_id="j1", requested_by="ada")
    plan = plan_batch(
        [LifecycleEvent(event("JobCancelRequested", cancel, FAILED_AT), cancel)],
        {"j1": requeued},
        {},
        policy(),
    )
    assert plan.updates["j1"].state is JobState.CANCELED
    assert [m.topic for m in plan.emits] == [topics.JOB_FINISHED, topics.JOB_STOP_ORDERED]


@pytest.mark.parametrize(
    ("rec", "attempt"),
    [
        (running(attempt=2), 1),  # an older run's failure
        (running(attempt=1, ended_attempt=1, state=JobState.QUEUED), 1),  # already ended
        (running(state=JobState.SUCCEEDED), 1),  # the job is over
        (running(state=JobState.FAILED, failures=3), 1),
    ],
)
def test_stale_or_duplicate_failures_change_nothing(rec: JobRecord, attempt: int) -> None:
    step = on_run_failed(rec, *failed(attempt), job(), BACKOFF)
    assert step.record is rec and step.emits == [] and step.history == []


def test_a_failure_is_counted_once_however_often_it_arrives() -> None:
    p, env = failed()
    item = LifecycleEvent(env, p)
    plan = plan_batch(
        [item, item], {"j1": running()}, {}, policy(), specs={"j1": job()}, time_scale=SCALE
    )
    assert plan.updates["j1"].failures == 1
    assert [m.topic for m in plan.emits] == [topics.JOB_QUEUED]


def test_a_failure_read_before_its_start_requeues_and_the_late_start_is_ignored() -> None:
    p, env = failed()
    start = JobStarted(job_id="j1", attempt=1, cluster="c1", nodes=["n1"], started_at=T0)
    end = JobFinished(job_id="j1", attempt=1, outcome=Outcome.FAILED)
    queued = replace(running(attempt=0), state=JobState.QUEUED)
    plan = plan_batch(
        [
            LifecycleEvent(env, p),
            LifecycleEvent(event("JobStarted", start, FAILED_AT), start),
            LifecycleEvent(event("JobFinished", end, FAILED_AT), end),
        ],
        {"j1": queued},
        {},
        policy(),
        specs={"j1": job()},
        time_scale=SCALE,
    )
    assert plan.updates["j1"].state is JobState.QUEUED
    assert [m.topic for m in plan.emits] == [topics.JOB_QUEUED]


def test_a_run_preempted_and_failed_is_requeued_once() -> None:
    node_p, node_env = preempted(reason="node_failure")
    fail_p, fail_env = failed()
    plan = plan_batch(
        [LifecycleEvent(node_env, node_p), LifecycleEvent(fail_env, fail_p)],
        {"j1": running()},
        {},
        policy(),
        specs={"j1": job()},
        time_scale=SCALE,
    )
    assert [m.topic for m in plan.emits] == [topics.JOB_QUEUED]
    assert plan.updates["j1"].failures == 0  # the platform's fault came first


# --- preemptions: a claim backs off, a node failure does not, neither is a failure -------


@pytest.mark.parametrize(
    "reason", ["preempted_for_priority", "reclaimed_borrowed", "preempted_attained_service"]
)
def test_a_preemption_for_a_claim_backs_off_keeping_the_submit_time(reason: str) -> None:
    step = on_preempted(running(), *preempted(reason=reason), job(), BACKOFF)
    assert step.record.state is JobState.QUEUED
    assert (step.record.claim_preemptions, step.record.failures) == (1, 0)
    [(topic, queued)] = emitted(step)
    assert topic == topics.JOB_QUEUED
    assert queued_not_before(queued) - FAILED_AT == wall(30)
    assert submitted_at(queued) == T0
    assert queued["requeue_of_attempt"] == 1


def test_claim_backoff_doubles_per_preemption_up_to_the_cap() -> None:
    rec = running()
    waits = []
    for attempt in range(1, 8):
        step = on_preempted(rec, *preempted(attempt), job(), BACKOFF)
        waits.append(queued_not_before(step.emits[0].envelope.payload) - FAILED_AT)
        rec = replace(step.record, state=JobState.RUNNING, attempt=attempt + 1)
    assert waits == [wall(s) for s in (30, 60, 120, 240, 480, 900, 900)]
    assert rec.claim_preemptions == 7 and rec.failures == 0


def test_the_history_says_how_much_work_was_kept_and_lost() -> None:
    p, env = preempted(work_kept_s=540, work_lost_s=60, for_job="urgent")
    step = on_preempted(running(), p, env, job(), BACKOFF)
    assert step.history[0].message == (
        "preempted (preempted_for_priority); 540 s of work kept, 60 s lost; "
        "requeued (requeue 1) in 30 s"
    )


@pytest.mark.parametrize("reason", ["node_failure", "cluster_lost", "preempted"])
def test_platform_failures_requeue_at_once_and_charge_nothing(reason: str) -> None:
    rec = running(failures=2, claim_preemptions=3)  # the retry budget is used up
    step = on_preempted(rec, *preempted(reason=reason, failed_nodes=["n1"]), job(), BACKOFF)
    assert step.record.state is JobState.QUEUED
    assert (step.record.failures, step.record.claim_preemptions) == (2, 3)
    queued = step.emits[0].envelope.payload
    assert queued.get("not_before") is None and queued["excluded_nodes"] == ["n1"]


# --- invariants ---------------------------------------------------------------------------


@given(
    max_retries=st.integers(0, 6),
    backoff_s=st.sampled_from([0.0, 1.0, 30.0, 600.0]),
    oom=st.booleans(),
    platform_ends=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_a_job_runs_at_most_one_plus_max_retries_failing_runs(
    max_retries: int, backoff_s: float, oom: bool, platform_ends: list[bool]
) -> None:
    """Whatever node failures come in between, a job that keeps failing is requeued exactly
    max_retries times for its failures, each wait twice the one before, then ends failed."""
    spec_ = job(max_retries=max_retries, backoff_s=backoff_s, oom_memory_factor=1.25)
    rec, attempt, retry_waits, memory = running(), 1, [], 32.0
    for platform in [*platform_ends, *[False] * (max_retries + 1)]:
        if platform:
            step = on_preempted(rec, *preempted(attempt, reason="node_failure"), spec_, BACKOFF)
        else:
            p, env = failed(attempt, reason="out_of_memory" if oom else "application_error")
            step = on_run_failed(rec, p, env, spec_, BACKOFF)
            if step.record.state is JobState.QUEUED:
                payload = step.emits[0].envelope.payload
                nb = payload.get("not_before")
                retry_waits.append(queued_not_before(payload) - FAILED_AT if nb else None)
                assert payload["spec"]["resources"]["memory_gb"] > memory or not oom
                memory = payload["spec"]["resources"]["memory_gb"]
        spec_ = step.spec or spec_
        rec = step.record
        if rec.state.terminal:
            break
        rec = replace(rec, state=JobState.RUNNING, attempt=attempt + 1)
        attempt += 1
    assert rec.state is JobState.FAILED and rec.failures == max_retries + 1
    expected = [wall(backoff_s * 2**i) if backoff_s else None for i in range(max_retries)]
    assert retry_waits == expected
