"""The queue's batch planning and job state machine, without a database or broker."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from aiokafka import ConsumerRecord

from schemas import topics
from schemas.events import (
    JobCancelRequested,
    JobFinished,
    JobPreempted,
    JobStarted,
    Outcome,
    PlacementDecided,
    PlacementRefused,
    ReplicaAssignment,
    RunFailed,
)
from schemas.job import JobState
from services.queue.intake import LIFECYCLE_TOPICS, LifecycleEvent, NewJob, read_batch
from services.queue.lifecycle import JobRecord
from services.queue.planning import plan_batch
from tests.unit.services.builders import T0, event, policy, spec, submission


def new_job(job_id: str, **fields: object) -> NewJob:
    return NewJob(f"ev-{job_id}", job_id, submission(**fields))


def placed(job_id: str, attempt: int = 1) -> LifecycleEvent:
    p = PlacementDecided(
        job_id=job_id,
        attempt=attempt,
        epoch=1,
        leader="s",
        cluster="c1",
        accelerator_type="H100",
        spec=spec(),
        replicas=[ReplicaAssignment(replica=0, node_id="n1", accelerators=1, cpu=1, memory_gb=1)],
    )
    return LifecycleEvent(event("PlacementDecided", p, T0 + timedelta(seconds=1)), p)


def lifecycle(event_type: str, payload: object) -> LifecycleEvent:
    return LifecycleEvent(event(event_type, payload, T0 + timedelta(seconds=2)), payload)


def record(job_id: str, state: JobState, attempt: int = 0) -> JobRecord:
    return JobRecord(job_id, "vision", state, T0, T0, attempt=attempt, cluster="c1")


def topics_of(plan: object) -> list[str]:
    return [m.topic for m in plan.emits]  # type: ignore[attr-defined]


def test_a_good_job_is_queued_and_announced() -> None:
    plan = plan_batch([new_job("j1")], {}, {}, policy())
    assert [r.state for r, _ in plan.inserts] == [JobState.QUEUED]
    assert topics_of(plan) == [topics.JOB_QUEUED]
    assert [h.state for h in plan.history] == [JobState.SUBMITTED, JobState.QUEUED]


def test_a_bad_job_is_stored_rejected_with_its_reason() -> None:
    plan = plan_batch([new_job("j1", queue="nope")], {}, {}, policy())
    assert [r.state for r, _ in plan.inserts] == [JobState.REJECTED]
    assert topics_of(plan) == [topics.JOB_REJECTED]
    assert plan.rejections[0][3] == "unknown_queue"


def test_redelivered_job_changes_nothing() -> None:
    records = {"j1": record("j1", JobState.QUEUED)}
    plan = plan_batch([new_job("j1")], records, {}, policy())
    assert plan.inserts == [] and plan.emits == [] and plan.duplicates == 1


def test_same_idempotency_key_twice_in_one_batch() -> None:
    items = [new_job("j1", idempotency_key="k"), new_job("j2", idempotency_key="k")]
    plan = plan_batch(items, {}, {}, policy())
    assert [r.job_id for r, _ in plan.inserts] == ["j1"]
    assert plan.rejections[0][3] == "duplicate_submission"
    assert "j1" in plan.rejections[0][4]


def test_job_id_of_another_tenant_is_refused() -> None:
    records = {"j1": record("j1", JobState.QUEUED)}
    plan = plan_batch([new_job("j1", tenant="nlp")], records, {}, policy())
    assert plan.rejections[0][3] == "duplicate_job_id"


def test_lifecycle_moves_forward_only() -> None:
    records = {"j1": record("j1", JobState.QUEUED)}
    started = lifecycle(
        "JobStarted", JobStarted(job_id="j1", attempt=1, cluster="c1", nodes=["n1"], started_at=T0)
    )
    plan = plan_batch([started, placed("j1")], records, {}, policy())
    # started arrived before placed: the late placement must not pull the job back
    assert plan.updates["j1"].state is JobState.RUNNING


def test_refusal_requeues_the_same_attempt_only() -> None:
    records = {"j1": record("j1", JobState.PLACED, attempt=2)}
    stale = lifecycle(
        "PlacementRefused",
        PlacementRefused(
            job_id="j1", attempt=1, epoch=1, cluster="c1", reason_code="x", message="m"
        ),
    )
    current = lifecycle(
        "PlacementRefused",
        PlacementRefused(
            job_id="j1", attempt=2, epoch=1, cluster="c1", reason_code="x", message="m"
        ),
    )
    assert plan_batch([stale], dict(records), {}, policy()).updates == {}
    plan = plan_batch([current], dict(records), {}, policy())
    assert plan.updates["j1"].state is JobState.QUEUED


def test_a_deposed_leaders_refused_copy_moves_nothing_even_with_a_cancel_waiting() -> None:
    """Two leaders placed attempt 1; the old copy is refused for its epoch while the new one is
    about to start. The job must not go back to queued, nor end canceled before its run does
    (that would end it twice: now, and when the stopped run ends)."""
    records = {"j1": replace(record("j1", JobState.PLACED, attempt=1), cancel_requested=True)}
    stale = lifecycle(
        "PlacementRefused",
        PlacementRefused(
            job_id="j1",
            attempt=1,
            epoch=1,
            cluster="c1",
            reason_code="stale_epoch",
            message="decided by leader epoch 1; epoch 2 leads now",
        ),
    )
    plan = plan_batch([stale], dict(records), {}, policy())
    assert "j1" not in plan.updates or plan.updates["j1"].state is JobState.PLACED
    assert topics_of(plan) == []


def test_cancel_of_a_queued_job_finishes_it_and_stops_inflight_placements() -> None:
    records = {"j1": record("j1", JobState.QUEUED)}
    cancel = lifecycle("JobCancelRequested", JobCancelRequested(job_id="j1", requested_by="u"))
    plan = plan_batch([cancel], records, {}, policy())
    assert plan.updates["j1"].state is JobState.CANCELED
    assert topics_of(plan) == [topics.JOB_FINISHED, topics.JOB_STOP_ORDERED]


def test_cancel_of_a_running_job_orders_a_stop_and_waits() -> None:
    records = {"j1": record("j1", JobState.RUNNING, attempt=1)}
    cancel = lifecycle("JobCancelRequested", JobCancelRequested(job_id="j1", requested_by="u"))
    plan = plan_batch([cancel], records, {}, policy())
    assert plan.updates["j1"].state is JobState.RUNNING
    assert plan.updates["j1"].cancel_requested
    assert topics_of(plan) == [topics.JOB_STOP_ORDERED]


def test_placement_after_cancel_is_stopped() -> None:
    records = {"j1": record("j1", JobState.CANCELED)}
    plan = plan_batch([placed("j1")], records, {}, policy())
    assert topics_of(plan) == [topics.JOB_STOP_ORDERED]


def test_cancel_of_a_finished_job_is_noted_and_ignored() -> None:
    records = {"j1": record("j1", JobState.SUCCEEDED)}
    cancel = lifecycle("JobCancelRequested", JobCancelRequested(job_id="j1", requested_by="u"))
    plan = plan_batch([cancel], records, {}, policy())
    assert plan.updates == {} and plan.emits == []
    assert plan.history[0].reason_code == "cancel_ignored"


def test_submit_and_finish_in_one_batch_rewrite_the_insert() -> None:
    finished = lifecycle(
        "JobFinished", JobFinished(job_id="j1", attempt=None, outcome=Outcome.CANCELED)
    )
    plan = plan_batch([new_job("j1"), finished], {}, {}, policy())
    assert [r.state for r, _ in plan.inserts] == [JobState.CANCELED]
    assert plan.updates == {}


def test_events_for_unknown_jobs_are_counted() -> None:
    plan = plan_batch([placed("nobody")], {}, {}, policy())
    assert plan.unknown_job_events == 1


def test_a_cancel_that_overtakes_its_job_is_kept_and_applied_on_arrival() -> None:
    cancel = lifecycle("JobCancelRequested", JobCancelRequested(job_id="j1", requested_by="u"))
    first = plan_batch([cancel], {}, {}, policy())
    assert first.early_cancels == [("j1", "u")] and first.unknown_job_events == 0
    plan = plan_batch([new_job("j1")], {}, {}, policy(), early_cancels={"j1": "u"})
    assert [r.state for r, _ in plan.inserts] == [JobState.CANCELED]
    assert topics_of(plan) == [topics.JOB_QUEUED, topics.JOB_FINISHED, topics.JOB_STOP_ORDERED]


def preempted(job_id: str, attempt: int = 1) -> LifecycleEvent:
    p = JobPreempted(
        job_id=job_id,
        attempt=attempt,
        cluster="c1",
        reason_code="node_failure",
        message="node n1 failed",
        failed_nodes=["n1"],
    )
    return LifecycleEvent(event("JobPreempted", p, T0 + timedelta(seconds=3)), p)


def test_a_run_ended_by_the_platform_is_requeued_avoiding_the_failed_node() -> None:
    records = {"j1": record("j1", JobState.RUNNING, attempt=1)}
    plan = plan_batch([preempted("j1")], records, {}, policy(), specs={"j1": spec(job_id="j1")})
    job = plan.updates["j1"]
    assert job.state is JobState.QUEUED and job.requeues == 1 and job.excluded_nodes == ("n1",)
    assert topics_of(plan) == [topics.JOB_QUEUED]
    queued = plan.emits[0].envelope.payload
    assert queued["requeue_of_attempt"] == 1 and queued["excluded_nodes"] == ["n1"]
    assert queued["submitted_at"].startswith("2026-01-01")  # the original submit time


def test_late_events_of_an_ended_run_do_not_revive_it() -> None:
    records = {"j1": record("j1", JobState.RUNNING, attempt=1)}
    started = lifecycle(
        "JobStarted", JobStarted(job_id="j1", attempt=1, cluster="c1", nodes=["n1"], started_at=T0)
    )
    plan = plan_batch(
        [preempted("j1"), started], records, {}, policy(), specs={"j1": spec(job_id="j1")}
    )
    assert plan.updates["j1"].state is JobState.QUEUED


def test_a_cancel_requested_run_that_is_preempted_ends_canceled() -> None:
    rec = record("j1", JobState.RUNNING, attempt=1)
    rec.cancel_requested = True
    plan = plan_batch([preempted("j1")], {"j1": rec}, {}, policy(), specs={"j1": spec(job_id="j1")})
    assert plan.updates["j1"].state is JobState.CANCELED
    assert topics_of(plan) == [topics.JOB_FINISHED]


def test_a_preemption_read_before_its_placement_still_requeues_once() -> None:
    records = {"j1": record("j1", JobState.QUEUED)}
    started = lifecycle(
        "JobStarted", JobStarted(job_id="j1", attempt=1, cluster="c1", nodes=["n1"], started_at=T0)
    )
    again = preempted("j1")
    plan = plan_batch(
        [preempted("j1"), placed("j1"), started, again],
        records,
        {},
        policy(),
        specs={"j1": spec(job_id="j1")},
    )
    assert plan.updates["j1"].state is JobState.QUEUED
    assert topics_of(plan) == [topics.JOB_QUEUED]  # one requeue, whatever came late


def test_the_end_of_a_run_already_requeued_does_not_end_the_job() -> None:
    records = {"j1": record("j1", JobState.RUNNING, attempt=1)}
    finished = lifecycle(
        "JobFinished", JobFinished(job_id="j1", attempt=1, outcome=Outcome.SUCCEEDED)
    )
    plan = plan_batch(
        [preempted("j1"), finished], records, {}, policy(), specs={"j1": spec(job_id="j1")}
    )
    assert plan.updates["j1"].state is JobState.QUEUED


def test_the_queue_reads_run_failures_from_their_topic() -> None:
    failure = RunFailed(
        job_id="j1", attempt=1, cluster="c1", reason_code="out_of_memory", message="OOM"
    )
    value = event("RunFailed", failure).model_dump_json().encode()
    raw = ConsumerRecord(topics.JOB_RUN_FAILED, 0, 0, 0, 0, None, value, None, 0, len(value), ())
    items, dead = read_batch((raw,))
    assert topics.JOB_RUN_FAILED in LIFECYCLE_TOPICS and dead == []
    [item] = items
    assert isinstance(item, LifecycleEvent) and item.payload == failure


def test_work_lost_to_a_preemption_is_counted_once_in_accelerator_seconds() -> None:
    gang = spec(job_id="j1", replicas=2, resources={"accelerators": 4})
    p = JobPreempted(
        job_id="j1",
        attempt=1,
        cluster="c1",
        reason_code="preempted_for_priority",
        message="room for a critical job",
        ran_s=100,
        work_kept_s=70,
        work_lost_s=30,
    )
    ended = LifecycleEvent(event("JobPreempted", p, T0 + timedelta(seconds=3)), p)
    redelivered_copy = LifecycleEvent(event("JobPreempted", p, T0 + timedelta(seconds=4)), p)
    records = {"j1": record("j1", JobState.RUNNING, attempt=1)}
    plan = plan_batch([ended, redelivered_copy], records, {}, policy(), specs={"j1": gang})
    assert plan.preempted == [("vision", "preempted_for_priority", 30 * 2 * 4)]


def test_a_preemption_that_ends_no_run_loses_nothing() -> None:
    records = {"j1": record("j1", JobState.QUEUED, attempt=1)}
    records["j1"].ended_attempt = 1  # that run ended already
    plan = plan_batch([preempted("j1")], records, {}, policy(), specs={"j1": spec(job_id="j1")})
    assert plan.preempted == []
