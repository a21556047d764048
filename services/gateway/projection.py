"""The gateway's read model of a job, folded from lifecycle events. Pure.

Like the queue, it only moves a job forward, because events about one job arrive on several
topics whose relative order is not guaranteed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from schemas.envelope import Envelope
from schemas.events import (
    JobCancelRequested,
    JobCheckpointRequested,
    JobFinished,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobStarted,
    PlacementHead,
    PlacementRefused,
    PreemptionCanceled,
    RunFailed,
)
from schemas.job import JobSpec, JobState
from services.common.frozen import evolve

_RANK = {JobState.SUBMITTED: 0, JobState.QUEUED: 1, JobState.PLACED: 2, JobState.RUNNING: 3}

# States in which a job's placement holds its devices (from the decision until the run ends).
HOLDING = frozenset({JobState.PLACED, JobState.RUNNING, JobState.PREEMPTING})


def rank(state: JobState) -> int:
    return 4 if state.terminal else _RANK.get(state, 3)


@dataclass(frozen=True)
class ReplicaPlacement:
    replica: int
    node_id: str
    accelerators: float
    # The node's device indices it takes; empty when the scheduler left the choice to the
    # executor (then only the amount on the node is known).
    devices: tuple[int, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where one attempt of a job was placed, replica by replica."""

    attempt: int
    cluster: str
    accelerator_type: str
    replicas: tuple[ReplicaPlacement, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "cluster": self.cluster,
            "accelerator_type": self.accelerator_type,
            "replicas": [
                {
                    "replica": r.replica,
                    "node_id": r.node_id,
                    "accelerators": r.accelerators,
                    "devices": list(r.devices),
                }
                for r in self.replicas
            ],
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Placement:
        return cls(
            attempt=int(doc["attempt"]),
            cluster=str(doc["cluster"]),
            accelerator_type=str(doc["accelerator_type"]),
            replicas=tuple(
                ReplicaPlacement(
                    int(r["replica"]),
                    str(r["node_id"]),
                    float(r["accelerators"]),
                    tuple(int(d) for d in r.get("devices") or ()),
                )
                for r in doc.get("replicas") or ()
            ),
        )


def placement_of(p: PlacementHead) -> Placement:
    return Placement(
        attempt=p.attempt,
        cluster=p.cluster,
        accelerator_type=p.accelerator_type,
        replicas=tuple(
            ReplicaPlacement(r.replica, r.node_id, r.accelerators, tuple(r.devices))
            for r in p.replicas
        ),
    )


def wanted_type(spec: JobSpec | None) -> str | None:
    """The accelerator type a job asks for, as one word to group by: its only acceptable type,
    several joined by `|` (sorted), or `any`."""
    if spec is None:
        return None
    types = spec.resources.accelerator_types
    if not types:
        return "any"
    return types[0] if len(types) == 1 else "|".join(sorted(set(types)))


@dataclass(frozen=True)
class JobView:
    job_id: str
    tenant: str
    state: JobState
    submitted_at: datetime
    updated_at: datetime
    spec: JobSpec | None = None
    attempt: int = 0
    ended_attempt: int = 0  # the last run the platform ended; its late events change nothing
    reason_code: str | None = None
    message: str | None = None
    cluster: str | None = None
    nodes: tuple[str, ...] = ()
    # The newest placement decided for it (attempt `placement.attempt`); it holds devices while
    # the job is in a HOLDING state of that same attempt.
    placement: Placement | None = None
    # Whether its row holds a spec: a stored spec is never rewritten (the upsert keeps the
    # row's own), so the projection need not send it back with every event, nor read it back
    # whole (`spec` is then None): what it needs of it comes with the row, the type the job asks
    # for (`wanted`) and the host memory per replica its first run asked for.
    spec_stored: bool = field(default=False, compare=False)
    wanted: str | None = field(default=None, compare=False)
    first_memory_gb: float | None = field(default=None, compare=False)

    @property
    def asked_type(self) -> str | None:
        """The accelerator type the job asks for (`wanted_type`); None while no spec is known."""
        return wanted_type(self.spec) if self.spec is not None else self.wanted

    @property
    def asked_memory_gb(self) -> float | None:
        """The host memory per replica the job's first run asked for, if known."""
        return self.spec.resources.memory_gb if self.spec is not None else self.first_memory_gb

    @property
    def accelerator_type(self) -> str | None:
        """The type it holds (or last held, once ended) when placed, else the type it asks for."""
        if self.placement is not None and (self.state in HOLDING or self.state.terminal):
            return self.placement.accelerator_type
        return self.asked_type

    @property
    def held(self) -> Placement | None:
        """The placement whose devices the job holds now, if any."""
        p = self.placement
        if p is not None and self.state in HOLDING and p.attempt == self.attempt:
            return p
        return None


@dataclass(frozen=True)
class EventLine:
    event_id: str
    job_id: str
    at: datetime
    type: str
    state: JobState | None
    reason_code: str | None = None
    message: str | None = None
    # The job a preemption made room for (JobPreempted, JobCheckpointRequested,
    # PreemptionCanceled): GET /v1/queues counts the preemptions each tenant caused by it.
    for_job: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "job_id": self.job_id,
            "at": self.at.isoformat(),
            "type": self.type,
            "state": self.state.value if self.state else None,
            "reason_code": self.reason_code,
            "message": self.message,
            "for_job": self.for_job,
        }


def submitted_view(spec: JobSpec, job_id: str, at: datetime) -> JobView:
    return JobView(job_id, spec.tenant, JobState.SUBMITTED, at, at, spec=spec)


def project(view: JobView | None, env: Envelope, payload: Any) -> tuple[JobView | None, EventLine]:
    at = env.occurred_at
    job_id = str(payload.job_id)
    new = _fold(view, env, payload, at)
    state = new.state if new is not None else None
    reason, message = _words(payload, new)
    for_job = getattr(payload, "for_job", None)
    return new, EventLine(
        env.event_id,
        job_id,
        at,
        env.type,
        state,
        reason,
        message,
        str(for_job) if for_job else None,
    )


def _advance(view: JobView, state: JobState, at: datetime, **changes: Any) -> JobView:
    if rank(state) < rank(view.state) or view.state.terminal:
        return view
    return evolve(view, state=state, updated_at=max(at, view.updated_at), **changes)


def _fold(view: JobView | None, env: Envelope, p: Any, at: datetime) -> JobView | None:
    if isinstance(p, JobQueued):
        base = view or JobView(p.job_id, p.spec.tenant, JobState.SUBMITTED, p.submitted_at, at)
        if base.spec is None and not base.spec_stored:
            base = evolve(base, spec=p.spec)  # the first spec heard is the one kept
        requeued = p.requeue_of_attempt is not None and p.requeue_of_attempt >= base.attempt
        if requeued and not base.state.terminal:
            # The platform ended the run: the one step back a job takes.
            return evolve(
                base,
                state=JobState.QUEUED,
                updated_at=max(at, base.updated_at),
                ended_attempt=max(base.ended_attempt, p.requeue_of_attempt or 0),
            )
        return _advance(base, JobState.QUEUED, at)
    if isinstance(p, JobRejected):
        if view is not None and (view.tenant != env.tenant or view.state is not JobState.SUBMITTED):
            # Only a job still being submitted can be rejected; anything else is a message about
            # someone else's job id (a bad spec from another producer reusing it).
            return view
        tenant = view.tenant if view else (env.tenant or "unknown")
        base = view or JobView(str(p.job_id), tenant, JobState.SUBMITTED, at, at)
        return _advance(
            base, JobState.REJECTED, at, reason_code=p.reason_code.value, message=p.message
        )
    if view is None:
        return None  # lifecycle of a job this gateway has not heard of yet
    if isinstance(p, PlacementHead):
        if p.attempt < view.attempt or p.attempt <= view.ended_attempt:
            return view
        nodes = tuple(sorted({r.node_id for r in p.replicas}))
        placement = placement_of(p)
        moved = _advance(
            view,
            JobState.PLACED,
            at,
            attempt=p.attempt,
            cluster=p.cluster,
            nodes=nodes,
            placement=placement,
        )
        if moved is view and (view.placement is None or view.placement.attempt <= p.attempt):
            # The run's start (another topic) came first: the job is already running this
            # attempt, or ended; the decision still says which devices it holds or held.
            return evolve(view, placement=placement)
        return moved
    if isinstance(p, JobCheckpointRequested):
        # The preemptor asked the run to checkpoint: it is stopped when the grace period ends.
        if p.attempt == view.attempt and view.state is JobState.RUNNING:
            return evolve(view, state=JobState.PREEMPTING, updated_at=max(at, view.updated_at))
        return view
    if isinstance(p, PreemptionCanceled):
        if p.attempt == view.attempt and view.state is JobState.PREEMPTING:
            return evolve(view, state=JobState.RUNNING, updated_at=max(at, view.updated_at))
        return view
    if isinstance(p, JobPreempted):
        leaving = (JobState.PLACED, JobState.RUNNING, JobState.PREEMPTING)
        if p.attempt == view.attempt and view.state in leaving:
            return evolve(
                view,
                state=JobState.QUEUED,
                updated_at=max(at, view.updated_at),
                ended_attempt=p.attempt,
            )
        return view
    if isinstance(p, RunFailed):
        # The queue decides whether the job is retried (job.queued) or ends (job.finished);
        # until then the state stays, but late events of this run move the job no more.
        if view.state.terminal or p.attempt <= view.ended_attempt or p.attempt < view.attempt:
            return view
        return evolve(view, ended_attempt=p.attempt, updated_at=max(at, view.updated_at))
    if isinstance(p, PlacementRefused):
        # A deposed leader's copy moves nothing: its successor's placement (of this attempt or
        # the next) does (queue.lifecycle.on_refused).
        if p.reason_code == "stale_epoch":
            return view
        if view.state is JobState.PLACED and p.attempt == view.attempt:
            return evolve(view, state=JobState.QUEUED, updated_at=at)
        return view
    if isinstance(p, JobStarted):
        if p.attempt < view.attempt or p.attempt <= view.ended_attempt:
            return view
        return _advance(
            view, JobState.RUNNING, at, attempt=p.attempt, cluster=p.cluster, nodes=tuple(p.nodes)
        )
    if isinstance(p, JobFinished):
        return _advance(
            view, JobState(p.outcome.value), at, reason_code=p.reason_code, message=p.message
        )
    return view  # JobCancelRequested changes nothing until the job actually stops


def _words(p: Any, view: JobView | None) -> tuple[str | None, str | None]:
    if isinstance(p, JobRejected):
        return p.reason_code.value, p.message
    if isinstance(p, JobPreempted) and (p.work_kept_s or p.work_lost_s):
        work = f"{p.work_kept_s:g} s of work kept, {p.work_lost_s:g} s lost"
        return p.reason_code, f"{p.message} ({work})"
    if isinstance(p, JobFinished | PlacementRefused | JobPreempted | RunFailed):
        return p.reason_code, p.message
    if isinstance(p, JobCheckpointRequested):
        stop = p.stop_at.isoformat(timespec="seconds")
        return "checkpoint_requested", (
            f"asked to checkpoint to make room for job {p.for_job} ({p.reason_code}); "
            f"stopped after its {p.grace_s:g} s grace period, at {stop}"
        )
    if isinstance(p, PreemptionCanceled):
        return p.reason_code, f"not preempted: {p.message}"
    if isinstance(p, PlacementHead):
        nodes = sorted({r.node_id for r in p.replicas})
        return None, f"placed on {p.cluster}: {', '.join(nodes)} (attempt {p.attempt})"
    if isinstance(p, JobStarted):
        return None, f"running on {len(p.nodes)} node(s) in {p.cluster}"
    if isinstance(p, JobCancelRequested):
        return "cancel_requested", f"cancel requested by {p.requested_by}"
    if isinstance(p, JobQueued):
        if p.requeue_of_attempt is not None:
            return "requeued", _requeued(p, view)
        return None, f"queued in {p.spec.queue}"
    return None, None


def _requeued(p: JobQueued, view: JobView | None) -> str:
    words = [f"requeued after attempt {p.requeue_of_attempt}"]
    if p.excluded_nodes:
        words.append(f"avoiding {', '.join(p.excluded_nodes)}")
    first = view.asked_memory_gb if view is not None else None
    memory = p.spec.resources.memory_gb
    if first is not None and first != memory:
        words.append(f"with {memory:g} GB memory per replica")  # grown after out of memory
    if p.not_before is not None:
        words.append(f"not placed before {p.not_before.isoformat(timespec='seconds')}")
    return ", ".join(words)
