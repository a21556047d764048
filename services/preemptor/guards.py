"""The preemptor's decisions, pure: whether a preemption request may go ahead (the guards, each
with a reason a person can act on), how long the victim gets to checkpoint, and what a due
timer does. No I/O and no clock of its own; `now` and the facts are given.

Durations named `*_s` in the policy and on the wire are fleet seconds; `stop_at`, `now` and
every datetime here are wall clock. `time_scale` is fleet seconds per wall second.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TypeVar

from core.policy import Policy

PRIORITY_REASON = "preempted_for_priority"
# A move to room free elsewhere (core/repack.py): no claim is taken from the victim.
REPACK_REASON = "repacked"

_T = TypeVar("_T", int, datetime)


class State(StrEnum):
    HELD = "held"  # waiting to see the victim's run start (topics are not ordered together)
    SIGNALED = "signaled"  # checkpoint requested; the stop order follows at stop_at
    ORDERED = "ordered"  # stop order sent to the executor
    DONE = "done"  # the victim's run ended after the order
    CANCELED = "canceled"  # refused, or called off during the grace period


ACTIVE = frozenset({State.HELD, State.SIGNALED, State.ORDERED, State.DONE})


class CancelReason(StrEnum):
    STALE_EPOCH = "stale_epoch"
    VICTIM_GONE = "victim_gone"
    CLAIM_NOT_HIGHER = "claim_not_higher"
    NOT_PREEMPTIBLE = "not_preemptible"
    REQUESTER_GONE = "requester_gone"
    REQUESTER_PLACED = "requester_placed"
    MIN_RUNTIME = "min_runtime"
    TENANT_BUDGET = "tenant_budget"


ClaimKey = tuple[int, bool, int]


@dataclass(frozen=True)
class Request:
    """A preemption request as the decisions need it (converted from the wire at the edge)."""

    id: str  # the request's event id
    job_id: str
    attempt: int
    cluster: str
    tenant: str
    priority_class: str
    claim: ClaimKey
    for_job: str
    for_priority_class: str
    for_claim: ClaimKey
    reason_code: str
    grace_s: float
    epoch: int
    requested_at: datetime  # the request's occurred_at (the scheduler's clock)
    for_tenant: str = ""  # the tenant the room is for (metrics only)


@dataclass(frozen=True)
class JobFacts:
    """What the lifecycle topics said about one job. Every field only ever grows (a later
    attempt, a later time, finished), so facts merge in any order: the topics are not ordered
    with each other and may be redelivered."""

    job_id: str
    started_attempt: int | None = None
    started_at: datetime | None = None  # of started_attempt
    ended_attempt: int | None = None  # highest attempt whose run ended
    finished: bool = False  # job.finished seen: the job is over
    closed: bool = False  # job.finished naming no attempt: the queue ended the whole job
    placed_at: datetime | None = None  # latest placement or start of any attempt
    preemptible: bool | None = None  # from its spec, once a placement was seen

    def run_ended(self, attempt: int) -> bool:
        return (
            self.closed
            or (self.ended_attempt is not None and self.ended_attempt >= attempt)
            or (self.started_attempt is not None and self.started_attempt > attempt)
        )

    def started_at_of(self, attempt: int) -> datetime | None:
        """When this run started, or None while its job.started has not been seen."""
        return self.started_at if self.started_attempt == attempt else None

    def placed_since(self, at: datetime) -> bool:
        return self.placed_at is not None and self.placed_at > at

    def merge(self, other: JobFacts) -> JobFacts:
        if _gt(other.started_attempt, self.started_attempt):
            started_attempt, started_at = other.started_attempt, other.started_at
        else:
            started_attempt, started_at = self.started_attempt, self.started_at
        return JobFacts(
            self.job_id,
            started_attempt,
            started_at,
            _max(self.ended_attempt, other.ended_attempt),
            self.finished or other.finished,
            self.closed or other.closed,
            _max(self.placed_at, other.placed_at),
            other.preemptible if other.preemptible is not None else self.preemptible,
        )


def _gt(a: int | None, b: int | None) -> bool:
    return a is not None and (b is None or a > b)


def _max(a: _T | None, b: _T | None) -> _T | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


@dataclass(frozen=True)
class Limits:
    """The policy knobs the guards read (fleet seconds) and the service's timing."""

    min_runtime_s: float
    grace_cap_s: float
    max_preemptions_per_tenant: int
    budget_window_s: float
    time_scale: float  # fleet seconds per wall second
    victim_wait_s: float  # wall seconds to wait for an unseen victim's job.started

    @classmethod
    def of(cls, policy: Policy, *, time_scale: float, victim_wait_s: float) -> Limits:
        p = policy.preemption
        return cls(
            p.min_runtime_s,
            p.grace_cap_s,
            p.max_preemptions_per_tenant,
            p.budget_window_s,
            time_scale,
            victim_wait_s,
        )

    def wall(self, fleet_s: float) -> timedelta:
        return timedelta(seconds=fleet_s / self.time_scale)

    def fleet_age(self, started_at: datetime, now: datetime) -> float:
        return max(0.0, (now - started_at).total_seconds() * self.time_scale)


# --- outcomes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Signal:
    """Go ahead: ask the victim to checkpoint; stop it at `stop_at`."""

    grace_s: float  # fleet seconds, capped by the policy
    stop_at: datetime


@dataclass(frozen=True)
class Cancel:
    reason: CancelReason
    message: str


@dataclass(frozen=True)
class Hold:
    """The victim's run has not been seen starting yet: look again until `until`."""

    until: datetime


@dataclass(frozen=True)
class Ignore:
    """Already being handled (a new leader asking again, or a redelivery)."""

    why: str


@dataclass(frozen=True)
class Order:
    """The grace period is over: stop the victim."""

    message: str


@dataclass(frozen=True)
class Situation:
    """Everything a request is judged against, read from the store at that moment."""

    fence_epoch: int  # highest leader epoch seen so far
    active: bool  # this victim run already has a preemption held, in progress or done
    victim: JobFacts
    requester: JobFacts
    tenant_signals: tuple[datetime, ...]  # when the victim tenant's recent runs were signaled
    received_at: datetime  # when the preemptor took the request (start of any hold)


def grace_for(requested_s: float, limits: Limits) -> float:
    return max(0.0, min(requested_s, limits.grace_cap_s))


def signals_in_window(signaled: Iterable[datetime], now: datetime, limits: Limits) -> int:
    """How many runs were signaled within the last budget window (fleet seconds)."""
    since = now - limits.wall(limits.budget_window_s)
    return sum(1 for at in signaled if since < at <= now)


def budget_since(now: datetime, limits: Limits) -> datetime:
    """The earliest signal time that still counts against a tenant's budget."""
    return now - limits.wall(limits.budget_window_s)


def decide_request(
    req: Request, s: Situation, policy: Policy, limits: Limits, now: datetime
) -> Signal | Cancel | Hold | Ignore:
    """The guards, cheapest and most certain first; the budget last, since passing it uses it."""
    if req.epoch < s.fence_epoch:
        return Cancel(
            CancelReason.STALE_EPOCH,
            f"the request to preempt job {req.job_id} came from scheduler epoch {req.epoch}, "
            f"but epoch {s.fence_epoch} leads now; the current leader asks again if it still "
            "needs the room",
        )
    if s.active:
        return Ignore(f"run {req.attempt} of job {req.job_id} is already being preempted")
    if s.victim.run_ended(req.attempt):
        return Cancel(CancelReason.VICTIM_GONE, _victim_gone(req))
    refusal = claim_refusal(req, policy)
    if refusal is not None:
        return Cancel(CancelReason.CLAIM_NOT_HIGHER, refusal)
    if s.victim.preemptible is False:
        return Cancel(
            CancelReason.NOT_PREEMPTIBLE,
            f"job {req.job_id} was submitted with preemptible: false; "
            f"job {req.for_job} must find room elsewhere",
        )
    gone = requester_change(req, s.requester)
    if gone is not None:
        return gone
    started_at = s.victim.started_at_of(req.attempt)
    if started_at is None:
        until = s.received_at + timedelta(seconds=limits.victim_wait_s)
        if now < until:
            return Hold(until)
        return Cancel(
            CancelReason.VICTIM_GONE,
            f"run {req.attempt} of job {req.job_id} was not seen running within "
            f"{limits.victim_wait_s:g} s of the request; nothing to preempt",
        )
    age = limits.fleet_age(started_at, now)
    if age < limits.min_runtime_s:
        return Cancel(
            CancelReason.MIN_RUNTIME,
            f"job {req.job_id} has run {age:.0f} s of its guaranteed "
            f"{limits.min_runtime_s:g} s; it will not be preempted before then",
        )
    used = signals_in_window(s.tenant_signals, now, limits)
    if used >= limits.max_preemptions_per_tenant:
        return Cancel(
            CancelReason.TENANT_BUDGET,
            f"tenant {req.tenant} already had {used} runs preempted in the last "
            f"{limits.budget_window_s:g} s (its budget is "
            f"{limits.max_preemptions_per_tenant} per window); job {req.job_id} keeps running",
        )
    grace = grace_for(req.grace_s, limits)
    return Signal(grace, now + limits.wall(grace))


def claim_refusal(req: Request, policy: Policy) -> str | None:
    """Why the requester's claim does not beat the victim's, or None if it does."""
    if req.reason_code == REPACK_REASON:
        return _repack_refusal(req, policy)
    if req.for_claim <= req.claim:
        return (
            f"job {req.for_job}'s claim {_claim(req.for_claim)} is not higher than job "
            f"{req.job_id}'s {_claim(req.claim)}; a job is only preempted for a strictly "
            "higher claim"
        )
    if req.reason_code != PRIORITY_REASON:
        return None
    asking = policy.priority(req.for_priority_class)
    if not asking.preempting:
        return (
            f"priority class {req.for_priority_class!r} of job {req.for_job} may not preempt "
            f"job {req.job_id} (the class is not `preempting` in the policy)"
        )
    if policy.rank(req.for_priority_class) <= policy.rank(req.priority_class):
        return (
            f"priority class {req.for_priority_class!r} (rank "
            f"{policy.rank(req.for_priority_class)}) of job {req.for_job} does not outrank "
            f"{req.priority_class!r} (rank {policy.rank(req.priority_class)}) of job {req.job_id}"
        )
    return None


def requester_change(req: Request, requester: JobFacts) -> Cancel | None:
    """The job the room was for no longer needs it."""
    if requester.finished:
        return Cancel(
            CancelReason.REQUESTER_GONE,
            f"job {req.for_job}, which the room was for, has ended; job {req.job_id} keeps running",
        )
    if requester.placed_since(req.requested_at):
        return Cancel(
            CancelReason.REQUESTER_PLACED,
            f"job {req.for_job} was placed after the request; job {req.job_id} keeps running",
        )
    return None


def decide_due(req: Request, victim: JobFacts, requester: JobFacts) -> Order | Cancel:
    """A signaled preemption whose grace period is over."""
    called_off = requester_change(req, requester)
    if called_off is not None:
        return called_off
    if victim.run_ended(req.attempt):
        return Cancel(CancelReason.VICTIM_GONE, _victim_gone(req))
    return Order(
        f"grace period over: stop run {req.attempt} of job {req.job_id} "
        f"to make room for job {req.for_job} ({req.reason_code})"
    )


def _victim_gone(req: Request) -> str:
    return (
        f"run {req.attempt} of job {req.job_id} has already ended; "
        f"its capacity is free for job {req.for_job} without a preemption"
    )


def _repack_refusal(req: Request, policy: Policy) -> str | None:
    """A move takes no capacity from the victim, so it needs no higher claim; but the policy
    must allow moves, and a job is never moved for a job of a lower priority rank."""
    if not (policy.preemption.enabled and policy.preemption.repack):
        return (
            f"job {req.job_id} would be moved to make room for job {req.for_job}, but "
            "preemption.repack is off in the policy"
        )
    if policy.rank(req.for_priority_class) < policy.rank(req.priority_class):
        return (
            f"job {req.job_id} ({req.priority_class!r}) is not moved for job {req.for_job} of "
            f"the lower priority class {req.for_priority_class!r}"
        )
    return None


def _claim(key: ClaimKey) -> str:
    rank, guaranteed, neg_level = key
    quota = "within quota" if guaranteed else "borrowing"
    return f"(rank {rank}, {quota}, level {-neg_level})"
