"""Inference services on the wire: a service declared (its desired state), commands on it
(scale, pause, resume, undo, delete), what its replicas report (ready, address, load) and the
status the serving service publishes (replicas, rollout, endpoints, the last change and why).

A service is one tenant's, named by `name` (a DNS label, unique across the platform: a router
addresses it by name). Its replicas are ordinary jobs of kind `inference_service`, one replica
each, whose ids the serving service makes (`svc-<name>-<n>`) and labels with `qm_service` and
`qm_version`; they go through the same queue, quota and scheduler as any other job.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from schemas.bounds import MAX_COMMAND_ITEMS, MAX_LABELS, Identifier, LongText, Name, Text
from schemas.events import Payload
from schemas.job import JobSpec, Resources, Retry, WorkloadKind

# A service name is a DNS label short enough that its replicas' job ids fit (svc-NAME-NNNNNNN).
ServiceName = Annotated[
    str, Field(min_length=1, max_length=40, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
]
MAX_SERVICE_REPLICAS = 512
# The labels the serving service puts on each replica's job.
SERVICE_LABEL = "qm_service"
VERSION_LABEL = "qm_version"
MAX_REPORTED_REPLICAS = 2 * MAX_SERVICE_REPLICAS + 64


class RolloutPolicy(Payload):
    """How a new version replaces the old (Kubernetes' rolling update, with an automatic
    roll-back)."""

    max_surge: int = Field(default=1, ge=0, le=MAX_SERVICE_REPLICAS)
    max_unavailable: int = Field(default=0, ge=0, le=MAX_SERVICE_REPLICAS)
    ready_timeout_s: float = Field(
        default=600, gt=0, le=86400, description="A placed replica not ready by then has failed."
    )


class ServiceSpec(Payload):
    """What a service should be: the model version its replicas run, how many, on what, and
    the load and latency each replica is meant for. Declaring it again with another version
    (or image, resources, command or labels) starts a rolling update; with other counts or
    targets it only rescales."""

    name: ServiceName
    tenant: Name
    project: Name = "default"
    user: Name = "unknown"
    queue: Name = "default"
    model: Text = Field(max_length=256, description="The model served (a name people read).")
    version: Name = Field(description="The model version; a new one is rolled out.")
    image: Text | None = Field(default=None, max_length=512)
    command: tuple[LongText, ...] = Field(default=(), max_length=MAX_COMMAND_ITEMS)
    resources: Resources = Resources()
    # Two labels are the platform's on each replica (qm_service, qm_version).
    labels: dict[Identifier, Text] = Field(default_factory=dict, max_length=MAX_LABELS - 2)
    priority_class: Name = Field(
        default="high",
        description="Its replicas' class; the minimum replicas must be able to preempt batch "
        "work, so this should be a preempting class.",
    )
    # At least one replica: with none, nothing reports the load that would scale it up.
    min_replicas: int = Field(default=1, ge=1, le=MAX_SERVICE_REPLICAS)
    max_replicas: int = Field(default=1, ge=1, le=MAX_SERVICE_REPLICAS)
    target_rps: float = Field(
        default=10.0, gt=0, le=1e9, description="Requests per second one replica is meant for."
    )
    latency_slo_ms: float = Field(
        default=1000.0, gt=0, le=3.6e6, description="The latency objective (reported percentile)."
    )
    scale_down_after_s: float = Field(
        default=300.0, ge=0, le=86400, description="Fewer replicas only after this quiet time."
    )
    rollout: RolloutPolicy = RolloutPolicy()
    drain_s: float = Field(
        default=30, ge=0, le=3600, description="A replica stopped gets this long to drain."
    )

    @model_validator(mode="after")
    def _counts(self) -> ServiceSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not be above max_replicas")
        if self.resources.accelerators <= 0:
            raise ValueError("a replica needs an accelerator or a share of one (accelerators > 0)")
        return self

    def template_differs(self, other: ServiceSpec) -> bool:
        """Whether replicas of `other` run something else than replicas of this spec (a new
        version to roll out), as opposed to only other counts or targets."""
        keys = {"version", "image", "command", "resources", "labels", "model", "priority_class"}
        return self.model_dump(include=keys) != other.model_dump(include=keys)

    def replica_job(self, job_id: str, *, guaranteed: bool) -> JobSpec:
        """The job of one replica: this template, one replica, never retried by the queue (the
        serving service replaces a failed replica, and a rollout judges the failure). A
        guaranteed replica (within the minimum) is not preemptible."""
        return JobSpec(
            job_id=job_id,
            tenant=self.tenant,
            project=self.project,
            user=self.user,
            queue=self.queue,
            name=f"{self.name} {self.version} replica",
            priority_class=self.priority_class,
            kind=WorkloadKind.INFERENCE_SERVICE,
            replicas=1,
            resources=self.resources,
            preemptible=not guaranteed,
            checkpoint_grace_s=self.drain_s,
            retry=Retry(max_retries=0),
            image=self.image,
            command=self.command,
            labels={**self.labels, SERVICE_LABEL: self.name, VERSION_LABEL: self.version},
            idempotency_key=job_id,
        )


class ServiceDeclared(Payload):
    """Command-like fact: this is the service's desired state from now on."""

    spec: ServiceSpec
    declared_by: Name = "unknown"


class ServiceAction(StrEnum):
    SCALE = "scale"  # new min/max (and optionally a fixed count: min = max)
    PAUSE = "pause"  # the rollout in progress stops where it is (scaling goes on)
    RESUME = "resume"
    UNDO = "undo"  # back to the previous version, by the same rolling update
    DELETE = "delete"  # every replica stops; the name is free again


class ServiceCommand(Payload):
    service: ServiceName
    tenant: Name
    action: ServiceAction
    min_replicas: int | None = Field(default=None, ge=1, le=MAX_SERVICE_REPLICAS)
    max_replicas: int | None = Field(default=None, ge=1, le=MAX_SERVICE_REPLICAS)
    requested_by: Name = "unknown"

    @model_validator(mode="after")
    def _scale(self) -> ServiceCommand:
        if self.action is ServiceAction.SCALE:
            if self.min_replicas is None and self.max_replicas is None:
                raise ValueError("scale needs min_replicas or max_replicas")
            low, high = self.min_replicas, self.max_replicas
            if low is not None and high is not None and low > high:
                raise ValueError("min_replicas must not be above max_replicas")
        return self


class ReplicaReported(Payload):
    """What a replica (or its agent: the executor, a router measuring it) says about itself:
    ready to serve and where, and/or the load it served over the last interval."""

    service: ServiceName
    replica: str = Field(min_length=1, max_length=64, description="The replica's job id.")
    version: Name | None = None
    attempt: int | None = Field(default=None, ge=0, description="The run reported on.")
    ready: bool | None = None
    address: str | None = Field(default=None, max_length=253)
    cluster: Name | None = None
    node: str | None = Field(default=None, max_length=253)
    rps: float | None = Field(default=None, ge=0, le=1e9)
    latency_ms: float | None = Field(default=None, ge=0, le=3.6e6)


class ServicePhase(StrEnum):
    STEADY = "steady"
    ROLLING = "rolling"
    ROLLING_BACK = "rolling_back"
    PAUSED = "paused"
    DELETED = "deleted"


class ReplicaView(Payload):
    replica: str
    version: str
    state: str  # pending, starting, ready, failed (core.serving.ReplicaState)
    guaranteed: bool
    since: datetime
    cluster: str | None = None
    node: str | None = None
    address: str | None = None


class Endpoint(Payload):
    replica: str
    version: str
    address: str


class ServiceStatus(Payload):
    """The serving service's view of one service after a change; the newest per key is the
    service's state, and `endpoints` is what a router should send requests to."""

    service: ServiceName
    tenant: Name
    phase: ServicePhase
    model: str
    version: str  # the version it is on, or rolling out to
    previous_version: str | None = None
    min_replicas: int
    max_replicas: int
    desired_replicas: int
    ready_replicas: int
    replicas: list[ReplicaView] = Field(default_factory=list, max_length=MAX_REPORTED_REPLICAS)
    endpoints: list[Endpoint] = Field(default_factory=list, max_length=MAX_REPORTED_REPLICAS)
    rollout_from: str | None = None
    rollout_started_at: datetime | None = None
    change: str = Field(default="", max_length=64, description="What changed: scaled, ...")
    reason: str = Field(default="", max_length=2000)
    revision: int = Field(default=0, ge=0, description="Counts the service's changes.")
