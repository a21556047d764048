"""Payloads of the events and commands on the job and node topics (the `payload` of an Envelope)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.bounds import Epoch, Name, NodeDevices, Price, RunSeconds
from schemas.job import JobSpec


class Payload(BaseModel):
    # NaN and Infinity are refused on every payload. Control and bidi characters in any string
    # of a record are refused when it is parsed (schemas.bounds.parse_json, parse_envelope),
    # once for the whole record rather than field by field.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RejectReason(StrEnum):
    """Why the queue refused a job; each has a sentence telling the submitter what to change."""

    MALFORMED = "malformed"  # not JSON, or not an object
    INVALID_SPEC = "invalid_spec"  # wrong types or missing fields
    UNKNOWN_TENANT = "unknown_tenant"
    UNKNOWN_QUEUE = "unknown_queue"
    UNKNOWN_PRIORITY_CLASS = "unknown_priority_class"
    UNKNOWN_ACCELERATOR_TYPE = "unknown_accelerator_type"
    INVALID_RESOURCES = "invalid_resources"  # zero or negative sizes
    GANG_TOO_LARGE = "gang_too_large"  # more replicas than the tenant may ask for
    TOO_MANY_ACCELERATORS = "too_many_accelerators"
    DUPLICATE_JOB_ID = "duplicate_job_id"  # another tenant's job already has this id
    BUDGET_EXHAUSTED = "budget_exhausted"  # a blocking budget of the tenant/project is used up
    DUPLICATE_SUBMISSION = "duplicate_submission"  # same idempotency key as an earlier job
    TOO_LARGE = "too_large"  # the record or the spec is over its size limit
    UNPROCESSABLE = "unprocessable"  # valid, but the queue could not store it (dead-lettered)


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


class JobSubmitted(Payload):
    """Type JobSubmitted. The payload *is* the job spec (see schemas.job.JobSpec)."""


class JobCancelRequested(Payload):
    job_id: str
    requested_by: str = Field(default="unknown", description="Tenant or role that asked.")
    reason: str | None = None


class JobQueued(Payload):
    job_id: str
    spec: JobSpec
    submitted_at: datetime = Field(description="Original submit time; kept across requeues.")
    attempt: int = Field(default=0, description="0 for the first queueing, +1 per requeue.")
    requeue_of_attempt: int | None = Field(
        default=None, description="On a requeue: the run attempt that ended (its capacity is free)."
    )
    excluded_nodes: list[str] = Field(
        default_factory=list, description="Nodes this job must avoid (they failed under it)."
    )
    not_before: datetime | None = Field(
        default=None,
        description="On a requeue with backoff: the scheduler places the job no earlier.",
    )
    queued_at: datetime | None = Field(
        default=None,
        description="On a requeue: when the job went back to the queue (the run ended).",
    )


class JobRejected(Payload):
    job_id: str | None = None
    reason_code: RejectReason
    message: str
    idempotency_key: str | None = None


class ReplicaAssignment(Payload):
    # Never negative: a negative amount would credit the executor's books (a careless or
    # hostile producer on the topic).
    replica: int = Field(ge=0)
    node_id: str = Field(max_length=253)
    accelerators: float = Field(ge=0, le=4096)
    cpu: float = Field(ge=0)
    memory_gb: float = Field(ge=0)
    # The node's devices this replica takes (indices): one for a fraction, as many as it asks
    # for whole ones. Empty from a scheduler that did not name them: the executor picks.
    devices: list[int] = Field(default_factory=list, max_length=1024)

    @model_validator(mode="after")
    def _devices_match(self) -> ReplicaAssignment:
        if not self.devices:
            return self
        if any(d < 0 or d >= 4096 for d in self.devices) or len(set(self.devices)) != len(
            self.devices
        ):
            raise ValueError("devices must be distinct device indices from 0 to 4095")
        if self.accelerators >= 1 and self.accelerators != int(self.accelerators):
            raise ValueError(
                f"a replica of {self.accelerators:g} accelerators names devices: whole "
                "devices come in whole numbers"
            )
        if self.accelerators <= 0:
            raise ValueError("a replica without accelerators names no devices")
        wanted = round(self.accelerators) if self.accelerators >= 1 else 1
        if len(self.devices) != wanted:
            raise ValueError(
                f"a replica of {self.accelerators:g} accelerators names {len(self.devices)} "
                f"devices; it takes {wanted}"
            )
        return self


class SpecHead(BaseModel):
    """What the services that follow placements without running them read of the placed
    job's spec: who pays for it and whether it may be preempted. The rest of the spec is
    skipped unparsed, which is most of the cost of reading a placement."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    tenant: Name
    project: Name = "default"
    user: Name = "unknown"
    preemptible: bool = True


class PlacementHead(Payload):
    """A placement as the gateway, the queue, the meter, the preemptor and the schedulers
    read it: every field of `PlacementDecided`, its spec as a `SpecHead`. The executor that
    runs the job reads the whole spec (and refuses a placement whose spec is not valid); a
    scheduler takes the placed job from its job.queued."""

    job_id: str
    attempt: int
    epoch: Epoch
    leader: str
    cluster: str
    accelerator_type: str
    replicas: list[ReplicaAssignment]
    spec: SpecHead


class PlacementDecided(PlacementHead):
    """The scheduler's decision; `epoch` fences a deposed leader's late decisions."""

    # The whole spec: a JobSpec holds every field of a SpecHead, with the same bounds.
    spec: JobSpec  # type: ignore[assignment]


class PlacementRefused(Payload):
    """The executor could not (or would not) honour a placement; the job goes back to pending."""

    job_id: str
    attempt: int
    epoch: Epoch
    cluster: str
    reason_code: str
    message: str


class JobStarted(Payload):
    job_id: str
    attempt: int
    cluster: str
    nodes: list[str]
    started_at: datetime


class JobFinished(Payload):
    """Terminal outcome of a job; `attempt` is None when it never ran (cancelled while queued)."""

    job_id: str
    attempt: int | None = None
    outcome: Outcome
    reason_code: str | None = None
    message: str | None = None
    cluster: str | None = None
    ran_s: RunSeconds = 0.0


class JobPreempted(Payload):
    """A run ended by the platform, not by the job: the node failed, the cluster went away, or
    room was made for a higher claim. The queue requeues the job; it is not terminal."""

    job_id: str
    attempt: int
    cluster: str
    reason_code: str
    message: str
    failed_nodes: list[str] = Field(default_factory=list)
    ran_s: RunSeconds = 0.0
    work_kept_s: RunSeconds = Field(
        default=0.0, description="Seconds of this run saved by its last checkpoint (fleet time)."
    )
    work_lost_s: RunSeconds = Field(
        default=0.0, description="Seconds of this run after its last checkpoint, to redo."
    )
    for_job: str | None = Field(
        default=None, description="On a preemption for a higher claim: the job it made room for."
    )


class RunFailed(Payload):
    """A run ended by the job itself failing (process exit, out of memory). Not terminal: the
    queue retries it if the job's retry policy allows, else ends the job `failed`."""

    job_id: str
    attempt: int
    cluster: str
    reason_code: str = Field(description="application_error or out_of_memory.")
    message: str
    exit_code: int | None = None
    ran_s: RunSeconds = 0.0


class Claim(Payload):
    """How strongly a job holds or asks for capacity; compared as a tuple, higher wins."""

    rank: int = Field(description="Priority class rank.")
    guaranteed: bool = Field(description="Within its tenant's nominal quota.")
    level: int = Field(default=0, description="Attained-service level; lower is stronger.")

    def key(self) -> tuple[int, bool, int]:
        return (self.rank, self.guaranteed, -self.level)


class PreemptionRequested(Payload):
    """The scheduler leader asks that a running job yield to a pending one (key: the victim)."""

    job_id: str = Field(description="The victim.")
    attempt: int = Field(description="The victim's run that must yield.")
    cluster: str
    tenant: str = Field(description="The victim's tenant.")
    priority_class: str
    claim: Claim = Field(description="The victim's claim.")
    for_job: str = Field(description="The pending job that needs the room.")
    for_tenant: str
    for_priority_class: str
    for_claim: Claim
    reason_code: str = Field(
        description=(
            "preempted_for_priority, reclaimed_borrowed, preempted_attained_service, or "
            "repacked (moved to room free elsewhere; no claim is taken)."
        )
    )
    message: str
    grace_s: float = Field(description="The victim's checkpoint grace period (fleet seconds).")
    epoch: Epoch
    leader: str


class LeaderFence(Payload):
    """A control record, not a decision: a new scheduler leader writes one to every partition of
    `placement.decided` and `preemption.requested` before it reads to the end and decides.

    A deposed leader can still be publishing when its lease runs out (a slow or stalled
    process). Whatever it wrote before the fence on a partition, the new leader reads before its
    first decision; whatever it wrote after, every consumer that honours epochs refuses, because
    on that partition it has already seen the higher epoch. Consumers with nothing to fence skip
    these records (their envelope type is `LeaderFence`)."""

    epoch: Epoch = Field(description="The new leader's lease epoch.")
    leader: str


class PreemptionCanceled(Payload):
    """The preemptor did not (or no longer will) preempt this run, and why (key: the victim)."""

    job_id: str
    attempt: int
    for_job: str
    reason_code: str = Field(
        description=(
            "min_runtime, tenant_budget, claim_not_higher, requester_gone, requester_placed, "
            "victim_gone, not_preemptible or stale_epoch."
        )
    )
    message: str


class JobCheckpointRequested(Payload):
    """Command to an executor: signal this run to checkpoint now; it is stopped at `stop_at`."""

    job_id: str
    attempt: int
    cluster: str
    grace_s: float = Field(description="Fleet seconds the job has to save its work.")
    stop_at: datetime = Field(description="When the stop order follows (wall clock).")
    for_job: str
    reason_code: str


class JobPreemptOrdered(Payload):
    """Command to an executor: the grace period is over, stop this run and hand it back."""

    job_id: str
    attempt: int
    cluster: str
    for_job: str
    reason_code: str
    message: str


class ReplicaProgress(Payload):
    replica: int
    node_id: str
    step_time_s: float = Field(description="Mean seconds per training step over the interval.")


class JobProgress(Payload):
    """How fast each replica of a running gang advances (key: job id); stragglers show here."""

    job_id: str
    attempt: int
    cluster: str
    replicas: list[ReplicaProgress]


class JobStopOrdered(Payload):
    """Command to an executor: stop this job's running replicas (cancel)."""

    job_id: str
    reason: str = "canceled"


class NodeInfo(Payload):
    node_id: str
    block: str
    rack: str
    nvlink_domain: str
    accelerator_type: str
    generation: str
    accelerator_memory_gb: float
    relative_speed: float
    accelerators: NodeDevices
    cpu: float
    memory_gb: float
    price_tier: str
    healthy: bool = True


class PoolNodeState(StrEnum):
    PROVISIONING = "provisioning"  # asked for, not ready yet (not in `nodes`)
    READY = "ready"  # takes work (in `nodes`)


class PoolNode(Payload):
    node_id: str = Field(max_length=253)
    state: PoolNodeState
    requested_at: datetime
    ready_at: datetime | None = None
    # Accelerators in use now (ready nodes).
    used: float = Field(default=0.0, ge=0)
    # Since when it has been empty (ready nodes).
    empty_since: datetime | None = None


class PoolStatus(Payload):
    """One elastic node pool of a cluster as its executor holds it."""

    pool: str = Field(max_length=128)
    accelerator_type: str = Field(max_length=128)
    accelerators_per_node: int = Field(ge=1, le=1024)
    price_tier: str = Field(max_length=32)
    min_nodes: int = Field(ge=0)
    max_nodes: int = Field(ge=0)
    desired_nodes: int = Field(ge=0)
    nodes: list[PoolNode] = Field(default_factory=list, max_length=10_000)
    # The last provisioning failure (stockout, quota) and when, until a node comes.
    failing: str | None = Field(default=None, max_length=1000)
    failed_at: datetime | None = None


class ClusterCapacity(Payload):
    """An executor's full inventory of its cluster; the scheduler builds its fleet from it."""

    cluster: str
    location: str
    kind: str
    prices: dict[str, dict[str, Price]] = Field(
        description="Accelerator type -> price tier -> price per accelerator-hour (0 to 100,000)."
    )
    nodes: list[NodeInfo]
    # Its elastic pools (the autoscaler reads them; the scheduler needs only `nodes`).
    pools: list[PoolStatus] = Field(default_factory=list, max_length=256)


class DemandItem(Payload):
    """A pending job the scheduler could not place for want of capacity, as its shape."""

    job_id: str = Field(max_length=253)
    tenant: str = Field(max_length=128)
    replicas: int = Field(ge=1, le=2048)
    accelerators: float = Field(ge=0, le=1024, description="Per replica.")
    accelerator_types: list[str] = Field(default_factory=list, max_length=64)
    accelerator_memory_gb: float | None = Field(default=None, ge=0)
    cpu: float = Field(default=0.0, ge=0)
    memory_gb: float = Field(default=0.0, ge=0)
    topology: str = Field(default="cluster", max_length=32)
    topology_required: bool = False
    preemptible: bool = True
    codes: list[str] = Field(default_factory=list, max_length=32)


class CapacityDemand(Payload):
    """The leading scheduler's pending work that waits for capacity (not for quota, fair
    share or priority), head of the queue first; sent when it changes and now and then."""

    scheduler: str = Field(max_length=253, description="The leader that sent it.")
    epoch: Epoch
    jobs: list[DemandItem] = Field(default_factory=list, max_length=2000)
    pending_jobs: int = Field(ge=0, description="All pending jobs, capacity-bound or not.")
    truncated: bool = False


class AutoscaleDecided(Payload):
    """The size one elastic pool should have, and which of its nodes should go. A size, not
    a delta: the same decision applied twice buys nothing twice."""

    cluster: str = Field(max_length=128)
    pool: str = Field(max_length=128)
    desired_nodes: int = Field(ge=0)
    remove: list[str] = Field(default_factory=list, max_length=10_000)
    for_jobs: list[str] = Field(default_factory=list, max_length=2000)
    reason: str = Field(default="", max_length=2000)
    # When the inventory the decision was taken on was sent: nodes asked for after it are
    # not the decision's to cancel.
    inventory_at: datetime | None = None


class NodeHeartbeat(Payload):
    node_id: str
    cluster: str
    healthy: bool = True
    accelerators: NodeDevices
    allocated_accelerators: float


class PendingExplained(Payload):
    """Why the scheduler has not placed a job yet; sent when the reason changes."""

    job_id: str
    codes: list[str]
    message: str
    pending_jobs: int = Field(description="How many jobs were waiting in that cycle.")


class DeadLetter(Payload):
    """A record a consumer gave up on (type DeadLetter, key the source topic). `value` is for
    people (text, escaped, truncated); `value_base64` holds the exact bytes (up to 64 KiB) so
    the record can be replayed, `size` and `sha256` name the whole original."""

    source_topic: str
    partition: int
    offset: int
    key: str | None = None
    value: str = Field(description="The raw message, as text (truncated to 64 KiB).")
    error: str
    consumer: str
    reason: str = Field(
        default="unreadable",
        description="Why: unreadable (cannot be parsed or validated), unprocessable (a "
        "consumer could not apply it: it cannot be stored), too_large, or unpublishable "
        "(the broker refused an event the service produced).",
    )
    value_base64: str | None = Field(
        default=None, description="The exact bytes of the record (first 64 KiB), base64."
    )
    size: int | None = Field(default=None, description="The record's size in bytes.")
    sha256: str | None = Field(default=None, description="SHA-256 of the whole record, hex.")
