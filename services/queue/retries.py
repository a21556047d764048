"""Runs that end before their job is done, and what follows (docs/retries.md). Pure.

- The job failed by its own fault (`job.run.failed`): retried while its `spec.retry` budget
  lasts, after a backoff that doubles per failure; an out-of-memory run is retried only with
  more memory. Then the job ends `failed`.
- The platform ended the run (`job.preempted`): always requeued, never charged to the retry
  budget. Only a preemption for a higher claim backs off, so that the room it made is not
  taken straight back; node and cluster failures requeue at once.

Durations in specs and the policy are fleet seconds; `not_before` is wall-clock time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from core.policy import Preemption
from schemas.envelope import Envelope
from schemas.events import JobPreempted, Outcome, RunFailed
from schemas.job import JobSpec, JobState
from services.common.frozen import evolve
from services.queue.lifecycle import (
    JobRecord,
    Step,
    cancel_now,
    ended_before,
    finish,
    note,
    requeue,
)

APPLICATION_ERROR = "application_error"
OUT_OF_MEMORY = "out_of_memory"
# Preemptions that make room for a stronger claim; the others (node_failure, cluster_lost,
# ...) are the platform's own faults.
CLAIM_REASONS = frozenset(
    {"preempted_for_priority", "reclaimed_borrowed", "preempted_attained_service"}
)


@dataclass(frozen=True)
class Backoff:
    """The policy's claim backoff (fleet seconds) and the fleet's clock rate."""

    claim_base_s: float = 30.0
    claim_cap_s: float = 900.0
    time_scale: float = 1.0  # fleet seconds per wall-clock second

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be positive, not {self.time_scale}")

    @classmethod
    def of(cls, preemption: Preemption, time_scale: float) -> Backoff:
        return cls(preemption.requeue_backoff_s, preemption.requeue_backoff_cap_s, time_scale)

    def claim_wait_s(self, preemptions: int) -> float:
        """Fleet seconds before the n-th claim preemption of a job may be placed again."""
        return min(self.claim_cap_s, self.claim_base_s * 2.0 ** max(0, preemptions - 1))

    def not_before(self, at: datetime, wait_s: float) -> datetime | None:
        return at + timedelta(seconds=wait_s / self.time_scale) if wait_s > 0 else None


def retry_wait_s(spec: JobSpec, failures: int) -> float:
    """Fleet seconds before the retry that follows `failures` earlier failures."""
    return spec.retry.backoff_s * 2.0**failures


def on_preempted(
    rec: JobRecord, p: JobPreempted, env: Envelope, spec: JobSpec | None, backoff: Backoff
) -> Step:
    """The platform ended the run: the whole gang goes back to the queue with its original
    submit time, avoiding the nodes that failed. Not charged to the retry budget."""
    step = Step(rec)
    if rec.state.terminal or ended_before(rec, p.attempt) or spec is None:
        return step
    if rec.cancel_requested:
        cancel_now(step, env, "canceled while it was being stopped")
        note(step, env, p.reason_code, p.message)
        return step
    wait = 0.0
    if p.reason_code in CLAIM_REASONS:
        step.record = evolve(rec, claim_preemptions=rec.claim_preemptions + 1)
        wait = backoff.claim_wait_s(step.record.claim_preemptions)
    number = requeue(
        step,
        env,
        spec,
        p.attempt,
        failed_nodes=p.failed_nodes,
        not_before=backoff.not_before(env.occurred_at, wait),
    )
    work = ""
    if p.work_kept_s or p.work_lost_s:
        work = f"; {p.work_kept_s:g} s of work kept, {p.work_lost_s:g} s lost"
    then = f" in {wait:g} s" if wait > 0 else ""
    note(step, env, p.reason_code, f"{p.message}{work}; requeued (requeue {number}){then}")
    return step


def on_run_failed(
    rec: JobRecord, p: RunFailed, env: Envelope, spec: JobSpec | None, backoff: Backoff
) -> Step:
    """The job's own run failed: retry it after a backoff while its budget lasts (with more
    memory after an out-of-memory, if the spec says how much), else end the job failed."""
    step = Step(rec)
    if rec.state.terminal or ended_before(rec, p.attempt) or spec is None:
        return step
    if rec.cancel_requested:
        cancel_now(step, env, "canceled while it was running")
        note(step, env, p.reason_code, p.message)
        return step
    retry = spec.retry
    oom = p.reason_code == OUT_OF_MEMORY
    if oom and retry.oom_memory_factor is None:
        memory = spec.resources.memory_gb
        return _fail(
            step,
            p,
            env,
            f"{p.message}; out of memory with {memory:g} GB per replica: raise "
            "resources.memory_gb, or set retry.oom_memory_factor to retry with more memory",
        )
    if rec.failures >= retry.max_retries:
        runs = rec.failures + 1
        times = "once" if runs == 1 else f"{runs} times"
        advice = "raise resources.memory_gb" if oom else "fix the error"
        return _fail(
            step,
            p,
            env,
            f"{p.message}; failed {times} (last on attempt {p.attempt}) and no retry is left "
            f"(retry.max_retries = {retry.max_retries}): {advice} and resubmit",
        )
    wait = retry_wait_s(spec, rec.failures)
    new_spec = _more_memory(spec) if oom else spec
    step.record = evolve(rec, failures=rec.failures + 1)
    requeue(step, env, new_spec, p.attempt, not_before=backoff.not_before(env.occurred_at, wait))
    msg = f"{p.message}; retry {rec.failures + 1} of {retry.max_retries} in {wait:g} s"
    if new_spec is not spec:
        step.spec = new_spec
        msg += (
            f" with {new_spec.resources.memory_gb:g} GB memory per replica "
            f"(was {spec.resources.memory_gb:g} GB)"
        )
    note(step, env, p.reason_code, msg)
    return step


def _fail(step: Step, p: RunFailed, env: Envelope, message: str) -> Step:
    reason = p.reason_code or APPLICATION_ERROR
    rec = step.record
    step.record = evolve(
        rec,
        state=JobState.FAILED,
        reason_code=reason,
        message=message,
        failures=rec.failures + 1,
        attempt=p.attempt,
        ended_attempt=p.attempt,
        cluster=p.cluster,
        updated_at=env.occurred_at,
    )
    step.emits.append(finish(step.record, env, Outcome.FAILED, reason, message))
    note(step, env, reason, message)
    return step


def _more_memory(spec: JobSpec) -> JobSpec:
    factor = spec.retry.oom_memory_factor or 1.0
    memory = round(spec.resources.memory_gb * factor, 3)
    resources = spec.resources.model_copy(update={"memory_gb": memory})
    return spec.model_copy(update={"resources": resources})
