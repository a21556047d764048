"""The envelope every message on every topic travels in."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.bounds import MAX_RECORD_BYTES, Identifier, Name, WireError, parse_json, plain
from schemas.ids import new_id

# A W3C trace context `traceparent` (version 00): trace id, parent span id, flags.
TRACEPARENT_PATTERN = r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
_TRACEPARENT = re.compile(TRACEPARENT_PATTERN)
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def valid_traceparent(value: object) -> bool:
    """Whether `value` is a usable version-00 traceparent (all-zero ids are invalid)."""
    return (
        isinstance(value, str)
        and len(value) == 55
        and _TRACEPARENT.match(value) is not None
        and value[3:35] != _ZERO_TRACE
        and value[36:52] != _ZERO_SPAN
    )


def utcnow() -> datetime:
    return datetime.now(UTC)


class Envelope(BaseModel):
    """Metadata shared by all events and commands; `payload` holds the typed body.

    Versioning: topic names carry no version; `version` says which payload shape this is and
    consumers upcast old versions (schemas.registry) before validating.
    """

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    event_id: Identifier = Field(default_factory=new_id, description="Unique, time-sortable id.")
    type: Identifier = Field(description="Event or command name, e.g. JobSubmitted.")
    version: int = Field(default=1, ge=1, le=1000)
    occurred_at: datetime = Field(default_factory=utcnow)
    producer: Identifier = Field(default="external", description="Service or system that wrote it.")
    tenant: Name | None = None
    trace_id: Identifier = Field(default_factory=new_id)
    causation_id: Identifier | None = Field(
        default=None, description="event_id of the message that caused this one."
    )
    traceparent: str | None = Field(
        default=None,
        pattern=TRACEPARENT_PATTERN,
        description=(
            "W3C trace context of the span that produced this message, when the producer "
            "traces (docs/tracing.md); a value that is not a valid version-00 traceparent is "
            "ignored, never refused."
        ),
    )
    payload: dict[str, Any] = Field(default_factory=dict)

    @field_validator("traceparent", mode="before")
    @classmethod
    def _usable_traceparent(cls, value: Any) -> Any:
        # Tracing is advisory: a bad trace context must never dead-letter the event it rides on.
        return value if valid_traceparent(value) else None

    @field_validator("tenant", mode="before")
    @classmethod
    def _no_tenant(cls, value: Any) -> Any:
        return None if value == "" else value  # an empty tenant means none


def parse_envelope(raw: bytes | str, *, max_bytes: int = MAX_RECORD_BYTES) -> Envelope:
    """A record's envelope, strictly: bounded, strict JSON (schemas.bounds.parse_json), then
    validated. Raises WireError or pydantic's ValidationError (both ValueErrors)."""
    if isinstance(raw, bytes) and len(raw) <= max_bytes and plain(raw):
        # Nothing the strict walk could refuse: pydantic parses the bytes itself (the hot
        # path of every consumer; several times faster than json.loads, walk and validate).
        return Envelope.model_validate_json(raw)
    doc = parse_json(raw, max_bytes=max_bytes)
    if not isinstance(doc, dict):
        raise WireError("malformed", f"the message must be a JSON object, got {type(doc).__name__}")
    return Envelope.model_validate(doc)
