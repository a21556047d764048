"""Planning what one batch does to the queue's state: pure, given the records it touches."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from core.policy import Policy
from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobCancelRequested,
    JobFinished,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobStarted,
    PlacementHead,
    PlacementRefused,
    RejectReason,
    RunFailed,
)
from schemas.job import JobSpec, JobState
from schemas.usage import BudgetExceeded
from services.common.admission import Rejection as Refusal
from services.common.admission import check_admission
from services.common.kafka import OutMessage, envelope_for
from services.queue import lifecycle, retries
from services.queue.budgets import BudgetBlock, check_budget, note_exceeded
from services.queue.intake import BadJob, Item, LifecycleEvent, NewJob
from services.queue.lifecycle import PRODUCER, HistoryEntry, JobRecord, Step
from services.queue.retries import Backoff

Rejection = tuple[str, str | None, str | None, str, str, datetime]


@dataclass
class Plan:
    inserts: list[tuple[JobRecord, JobSpec]] = field(default_factory=list)
    updates: dict[str, JobRecord] = field(default_factory=dict)
    spec_updates: dict[str, JobSpec] = field(default_factory=dict)  # e.g. more memory after OOM
    history: list[HistoryEntry] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    emits: list[OutMessage] = field(default_factory=list)
    early_cancels: list[tuple[str, str]] = field(default_factory=list)
    unknown_job_events: int = 0
    duplicates: int = 0
    budget_blocks: dict[str, BudgetBlock] = field(default_factory=dict)
    # Runs the platform took away (job.preempted that ended a run): tenant, reason code and
    # the accelerator-seconds of work lost (fleet seconds lost times the gang's accelerators).
    preempted: list[tuple[str, str, float]] = field(default_factory=list)


def item_event_id(item: Item) -> str:
    return item.envelope.event_id if isinstance(item, LifecycleEvent) else item.event_id


def item_job_id(item: Item) -> str | None:
    if isinstance(item, NewJob):
        return item.job_id
    if isinstance(item, BadJob):
        return item.bad.job_id
    return getattr(item.payload, "job_id", None)  # budget.exceeded is about no job


def plan_batch(
    items: list[Item],
    records: dict[str, JobRecord],
    idempotency: dict[tuple[str, str], str],
    policy: Policy,
    early_cancels: dict[str, str] | None = None,
    specs: dict[str, JobSpec] | None = None,
    budget_blocks: dict[str, BudgetBlock] | None = None,
    time_scale: float = 1.0,
) -> Plan:
    """`early_cancels`: job id -> who asked, for cancels that arrived before their job.
    `specs`: the stored specs of jobs whose run ended (they may be requeued).
    `time_scale`: fleet seconds per wall-clock second, to turn backoffs into `not_before`."""
    plan = Plan(budget_blocks=dict(budget_blocks or {}))
    inserted: set[str] = set()
    early = dict(early_cancels or {})
    specs = dict(specs or {})
    backoff = Backoff.of(policy.preemption, time_scale)
    for item in items:
        if isinstance(item, LifecycleEvent) and isinstance(item.payload, BudgetExceeded):
            plan.budget_blocks = note_exceeded(plan.budget_blocks, item.payload)
        elif isinstance(item, NewJob):
            _plan_new(plan, item, records, idempotency, policy, inserted)
            if item.job_id in early and item.job_id in inserted:
                _cancel_on_arrival(plan, item, records, early.pop(item.job_id), inserted)
        elif isinstance(item, BadJob):
            _plan_bad(plan, item)
        else:
            _plan_lifecycle(plan, item, records, inserted, specs, backoff)
    return plan


def _reject(
    plan: Plan,
    env: Envelope,
    job_id: str | None,
    tenant: str | None,
    reason: RejectReason,
    message: str,
    idem: str | None,
) -> None:
    event = JobRejected(job_id=job_id, reason_code=reason, message=message, idempotency_key=idem)
    plan.emits.append(
        OutMessage(
            topics.JOB_REJECTED,
            job_id or tenant or "unknown",
            envelope_for("JobRejected", event, producer=PRODUCER, tenant=tenant, cause=env),
        )
    )
    plan.rejections.append((env.event_id, job_id, tenant, reason.value, message, env.occurred_at))


def _plan_new(
    plan: Plan,
    item: NewJob,
    records: dict[str, JobRecord],
    idempotency: dict[tuple[str, str], str],
    policy: Policy,
    inserted: set[str],
) -> None:
    env, spec = item.submission.envelope, item.submission.spec
    existing = records.get(item.job_id)
    if existing is not None:
        if existing.tenant == spec.tenant:
            plan.duplicates += 1  # the same job delivered again
            return
        _reject(
            plan,
            env,
            None,
            spec.tenant,
            RejectReason.DUPLICATE_JOB_ID,
            f"job id {item.job_id!r} is already taken; submit without job_id or pick another",
            spec.idempotency_key,
        )
        return
    key = (spec.tenant, spec.idempotency_key) if spec.idempotency_key else None
    if key is not None and key in idempotency:
        _reject(
            plan,
            env,
            item.job_id,
            spec.tenant,
            RejectReason.DUPLICATE_SUBMISSION,
            f"idempotency key {spec.idempotency_key!r} was already used by job "
            f"{idempotency[key]}; that job is the one running this request",
            spec.idempotency_key,
        )
        return
    now = env.occurred_at
    spec = spec.model_copy(update={"job_id": item.job_id})
    rejection = check_admission(spec, policy)
    if rejection is None:
        refusal = check_budget(spec.tenant, spec.project, plan.budget_blocks, now)
        if refusal is not None:
            rejection = Refusal(RejectReason.BUDGET_EXHAUSTED, refusal.message)
    state = JobState.REJECTED if rejection else JobState.QUEUED
    record = JobRecord(
        item.job_id,
        spec.tenant,
        state,
        submitted_at=now,
        updated_at=now,
        reason_code=rejection.reason.value if rejection else None,
        message=rejection.message if rejection else None,
    )
    records[item.job_id] = record
    inserted.add(item.job_id)
    if key is not None:
        idempotency[key] = item.job_id
    plan.inserts.append((record, spec))
    plan.history.append(
        HistoryEntry(
            item.job_id,
            now,
            JobState.SUBMITTED,
            env.type,
            env.event_id,
            None,
            f"submitted by {spec.user}",
        )
    )
    if rejection is not None:
        plan.history.append(
            HistoryEntry(
                item.job_id,
                now,
                state,
                "JobRejected",
                env.event_id,
                rejection.reason.value,
                rejection.message,
            )
        )
        _reject(
            plan,
            env,
            item.job_id,
            spec.tenant,
            rejection.reason,
            rejection.message,
            spec.idempotency_key,
        )
        return
    queued = JobQueued(job_id=item.job_id, spec=spec, submitted_at=now)
    plan.history.append(HistoryEntry(item.job_id, now, state, "JobQueued", env.event_id))
    plan.emits.append(
        OutMessage(
            topics.JOB_QUEUED,
            item.job_id,
            envelope_for("JobQueued", queued, producer=PRODUCER, tenant=spec.tenant, cause=env),
        )
    )


def _plan_bad(plan: Plan, item: BadJob) -> None:
    plan.emits.append(item.dead)
    bad = item.bad
    env = item.dead.envelope
    if bad.job_id is not None:
        _reject(plan, env, bad.job_id, bad.tenant, bad.reason, bad.message, bad.idempotency_key)
    else:
        plan.rejections.append(
            (item.event_id, None, bad.tenant, bad.reason.value, bad.message, env.occurred_at)
        )


def _plan_lifecycle(
    plan: Plan,
    item: LifecycleEvent,
    records: dict[str, JobRecord],
    inserted: set[str],
    specs: dict[str, JobSpec],
    backoff: Backoff,
) -> None:
    job_id = str(item.payload.job_id)
    record = records.get(job_id)
    if record is None:
        if isinstance(item.payload, JobCancelRequested):
            plan.early_cancels.append((job_id, item.payload.requested_by))
        else:
            plan.unknown_job_events += 1
        return
    spec = specs.get(job_id)
    step = _transition(record, item, spec, backoff)
    if isinstance(item.payload, JobPreempted) and step.record is not record and spec is not None:
        lost = item.payload.work_lost_s * spec.replicas * spec.resources.accelerators
        plan.preempted.append((record.tenant, item.payload.reason_code, lost))
    if step.spec is not None:
        specs[job_id] = step.spec  # a later requeue in this batch carries it on
    _apply_step(plan, job_id, step, records, inserted)


def _cancel_on_arrival(
    plan: Plan, item: NewJob, records: dict[str, JobRecord], who: str, inserted: set[str]
) -> None:
    cancel = JobCancelRequested(
        job_id=item.job_id, requested_by=who, reason="cancel arrived before the job"
    )
    env = envelope_for(
        "JobCancelRequested",
        cancel,
        producer=PRODUCER,
        tenant=records[item.job_id].tenant,
        cause=item.submission.envelope,
    )
    step = lifecycle.on_cancel(records[item.job_id], cancel, env)
    _apply_step(plan, item.job_id, step, records, inserted)


def _apply_step(
    plan: Plan, job_id: str, step: Step, records: dict[str, JobRecord], inserted: set[str]
) -> None:
    record = records[job_id]
    records[job_id] = step.record
    if step.record is not record and job_id not in inserted:
        plan.updates[job_id] = step.record
    elif step.record is not record:
        # Changed in the same batch that created it: rewrite the pending insert instead.
        plan.inserts = [(step.record if r.job_id == job_id else r, s) for r, s in plan.inserts]
    if step.spec is not None:
        plan.spec_updates[job_id] = step.spec
    plan.history.extend(step.history)
    plan.emits.extend(step.emits)


def _transition(
    record: JobRecord, item: LifecycleEvent, spec: JobSpec | None, backoff: Backoff
) -> Step:
    p, env = item.payload, item.envelope
    if isinstance(p, RunFailed):
        return retries.on_run_failed(record, p, env, spec, backoff)
    if isinstance(p, JobPreempted):
        return retries.on_preempted(record, p, env, spec, backoff)
    if isinstance(p, PlacementHead):
        return lifecycle.on_placed(record, p, env)
    if isinstance(p, PlacementRefused):
        return lifecycle.on_refused(record, p, env)
    if isinstance(p, JobStarted):
        return lifecycle.on_started(record, p, env)
    if isinstance(p, JobFinished):
        return lifecycle.on_finished(record, p, env)
    if isinstance(p, JobCancelRequested):
        return lifecycle.on_cancel(record, p, env)
    raise TypeError(f"no transition for {type(p).__name__}")
