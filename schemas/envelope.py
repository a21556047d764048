"""The envelope every message on every topic travels in."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.ids import new_id


def utcnow() -> datetime:
    return datetime.now(UTC)


class Envelope(BaseModel):
    """Metadata shared by all events and commands; `payload` holds the typed body.

    Versioning: topic names carry no version; `version` says which payload shape this is and
    consumers upcast old versions (schemas.registry) before validating.
    """

    model_config = ConfigDict(extra="ignore")

    event_id: str = Field(default_factory=new_id, description="Unique, time-sortable id.")
    type: str = Field(description="Event or command name, e.g. JobSubmitted.")
    version: int = Field(default=1, ge=1)
    occurred_at: datetime = Field(default_factory=utcnow)
    producer: str = Field(default="external", description="Service or system that wrote it.")
    tenant: str | None = None
    trace_id: str = Field(default_factory=new_id)
    causation_id: str | None = Field(
        default=None, description="event_id of the message that caused this one."
    )
    payload: dict[str, Any] = Field(default_factory=dict)
