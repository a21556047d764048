"""The job spec: what a researcher or another platform asks Quartermaster to run."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.bounds import (
    MAX_COMMAND_ITEMS,
    MAX_LABELS,
    MAX_REPLICAS,
    MAX_SPEC_BYTES,
    IdempotencyKey,
    Identifier,
    JobId,
    LongText,
    Name,
    Text,
    json_size,
)


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

# Every model on the wire refuses NaN and Infinity (schemas/bounds.py).
STRICT = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)


class Resources(BaseModel):
    """What one replica of the gang needs."""

    model_config = STRICT

    accelerators: float = Field(
        default=1,
        le=1024,
        description="Accelerators per replica; a fraction below 1 shares one device.",
    )
    accelerator_types: tuple[Name, ...] = Field(
        default=(),
        max_length=32,
        description="Acceptable accelerator types (e.g. H100, A100, TPU-v5e); empty means any.",
    )
    accelerator_memory_gb: float | None = Field(
        default=None, le=1 << 20, description="Minimum memory per accelerator, in GB."
    )
    cpu: float = Field(default=4, le=1 << 20, description="CPU cores per replica.")
    memory_gb: float = Field(default=32, le=1 << 30, description="Host memory per replica, in GB.")

    @field_validator("accelerators")
    @classmethod
    def _fraction_or_whole(cls, value: float) -> float:
        # A fraction shares one device; above one it must be whole devices.
        if value > 1 and value != int(value):
            raise ValueError("accelerators above 1 must be a whole number")
        return value


class Topology(BaseModel):
    model_config = STRICT

    level: TopologyLevel = Field(
        default=TopologyLevel.CLUSTER, description="Tightest domain the whole gang must share."
    )
    required: bool = Field(
        default=False, description="Required (never placed otherwise) or only preferred."
    )


class Retry(BaseModel):
    """What happens when the job itself fails (node and cluster failures never count)."""

    model_config = STRICT

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

    model_config = STRICT

    job_id: JobId | None = Field(
        default=None,
        description="Set by the gateway; external producers may set their own unique id "
        "(letters, digits and `._:-`, at most 64).",
    )
    tenant: Name = Field(description="The team that owns and pays for the job.")
    project: Name = "default"
    user: Name = "unknown"
    queue: Name = "default"
    name: Text | None = Field(default=None, max_length=256)
    priority_class: Name = "normal"
    kind: WorkloadKind = WorkloadKind.TRAINING
    replicas: int = Field(
        default=1, le=MAX_REPLICAS, description="Gang size: all replicas start or none do."
    )
    resources: Resources = Resources()
    topology: Topology = Topology()
    preemptible: bool = True
    checkpoint_grace_s: float = Field(default=30, ge=0, le=3600)
    max_runtime_s: float | None = Field(default=None, gt=0, le=365 * 86400)
    retry: Retry = Retry()
    image: Text | None = Field(default=None, max_length=512)
    command: tuple[LongText, ...] = Field(default=(), max_length=MAX_COMMAND_ITEMS)
    labels: dict[Identifier, Text] = Field(default_factory=dict, max_length=MAX_LABELS)
    idempotency_key: IdempotencyKey | None = None

    @model_validator(mode="after")
    def _gang_shape(self) -> JobSpec:
        if self.replicas > 1 and self.resources.accelerators < 1:
            raise ValueError("a gang of several replicas needs whole accelerators per replica")
        return self

    @model_validator(mode="after")
    def _size(self) -> JobSpec:
        # Each field is bounded; the whole must still fit in the events that carry it. A
        # cheap upper bound first (a character is at most 6 bytes as escaped JSON), so the
        # usual small spec is not serialised twice.
        # (Every spec read off a record passes here, and most have no command or labels.)
        command, labels = self.command, self.labels
        rough = len(self.name or "") + len(self.image or "")
        items = 0
        if command:
            rough += sum(map(len, command))
            items += len(command)
        if labels:
            rough += sum(map(len, labels)) + sum(map(len, labels.values()))
            items += 2 * len(labels)
        if 6 * rough + 4 * items + 4096 <= MAX_SPEC_BYTES:
            return self
        size = json_size(self.model_dump(mode="json", exclude_none=True))
        if size > MAX_SPEC_BYTES:
            raise ValueError(
                f"the spec is {size:,} bytes as JSON; the limit is {MAX_SPEC_BYTES:,} bytes "
                "(shorten command, labels or name)"
            )
        return self

    @property
    def total_accelerators(self) -> float:
        return self.replicas * self.resources.accelerators
