"""Request and response bodies of the REST API (the OpenAPI document is generated from these)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from schemas.job import JobSpec, Name


class SubmitJob(JobSpec):
    """A job spec; `tenant` defaults to the caller's tenant and `job_id` is assigned here."""

    tenant: Name | None = None  # type: ignore[assignment]


class Submitted(BaseModel):
    job_id: str
    state: str
    duplicate: bool = Field(
        default=False, description="True when this idempotency key was already used."
    )


class Problem(BaseModel):
    reason_code: str
    message: str


class HistoryItem(BaseModel):
    event_id: str
    at: datetime
    type: str
    state: str | None
    reason_code: str | None = None
    message: str | None = None


class JobStatus(BaseModel):
    job_id: str
    tenant: str
    project: str | None
    user: str | None
    queue: str | None
    name: str | None
    state: str
    reason_code: str | None
    message: str | None
    cluster: str | None
    nodes: list[str]
    replicas: int | None
    accelerators: float | None
    submitted_at: datetime
    updated_at: datetime
    spec: dict[str, Any] | None
    history: list[HistoryItem]


class JobSummary(BaseModel):
    job_id: str
    tenant: str
    project: str | None
    queue: str | None
    name: str | None
    state: str
    replicas: int | None
    accelerators: float | None
    cluster: str | None
    submitted_at: datetime
    updated_at: datetime


class JobList(BaseModel):
    jobs: list[JobSummary]


class CancelAccepted(BaseModel):
    job_id: str
    state: str = "cancel_requested"
