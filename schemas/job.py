"""The job spec: what a researcher or another platform asks Quartermaster to run."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class WorkloadKind(StrEnum):
    TRAINING = "training"
    EVALUATION = "evaluation"
    BATCH_INFERENCE = "batch_inference"
    INFERENCE_SERVICE = "inference_service"


class TopologyLevel(StrEnum):
    """How close the replicas of a gang must sit, tightest first."""

    NODE = "node"
    NVLINK = "nvlink"
    RACK = "rack"
    BLOCK = "block"
    CLUSTER = "cluster"


class JobState(StrEnum):
    SUBMITTED = "submitted"
    QUEUED = "queued"
    PLACED = "placed"
    RUNNING = "running"
    PREEMPTING = "preempting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED, JobState.REJECTED}
)

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")]


class Resources(BaseModel):
    """What one replica of the gang needs."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    accelerators: float = Field(
        default=1,
        description="Accelerators per replica; a fraction below 1 shares one device.",
    )
    accelerator_types: tuple[str, ...] = Field(
        default=(),
        description="Acceptable accelerator types (e.g. H100, A100, TPU-v5e); empty means any.",
    )
    accelerator_memory_gb: float | None = Field(
        default=None, description="Minimum memory per accelerator, in GB."
    )
    cpu: float = Field(default=4, description="CPU cores per replica.")
    memory_gb: float = Field(default=32, description="Host memory per replica, in GB.")

    @field_validator("accelerators")
    @classmethod
    def _fraction_or_whole(cls, value: float) -> float:
        # A fraction shares one device; above one it must be whole devices.
        if value > 1 and value != int(value):
            raise ValueError("accelerators above 1 must be a whole number")
        return value


class Topology(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    level: TopologyLevel = Field(
        default=TopologyLevel.CLUSTER, description="Tightest domain the whole gang must share."
    )
    required: bool = Field(
        default=False, description="Required (never placed otherwise) or only preferred."
    )


class Retry(BaseModel):
    """What happens when the job itself fails (node and cluster failures never count)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    max_retries: int = Field(
        default=2, ge=0, le=20, description="Runs retried after an application error or OOM."
    )
    backoff_s: float = Field(
        default=30, ge=0, le=86400, description="Wait before the first retry; doubles each time."
    )
    oom_memory_factor: float | None = Field(
        default=None,
        gt=1,
        le=4,
        description="On out of memory, retry with host memory times this; unset fails at once.",
    )


class JobSpec(BaseModel):
    """Every field a job carries (ARCHITECTURE §2). Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    job_id: str | None = Field(
        default=None,
        max_length=64,
        description="Set by the gateway; external producers may set their own unique id.",
    )
    tenant: Name = Field(description="The team that owns and pays for the job.")
    project: Name = "default"
    user: Name = "unknown"
    queue: Name = "default"
    name: str | None = Field(default=None, max_length=256)
    priority_class: Name = "normal"
    kind: WorkloadKind = WorkloadKind.TRAINING
    replicas: int = Field(default=1, description="Gang size: all replicas start or none do.")
    resources: Resources = Resources()
    topology: Topology = Topology()
    preemptible: bool = True
    checkpoint_grace_s: float = Field(default=30, ge=0, le=3600)
    max_runtime_s: float | None = Field(default=None, gt=0)
    retry: Retry = Retry()
    image: str | None = None
    command: tuple[str, ...] = ()
    labels: dict[str, str] = Field(default_factory=dict)
    idempotency_key: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _gang_shape(self) -> JobSpec:
        if self.replicas > 1 and self.resources.accelerators < 1:
            raise ValueError("a gang of several replicas needs whole accelerators per replica")
        return self

    @property
    def total_accelerators(self) -> float:
        return self.replicas * self.resources.accelerators
