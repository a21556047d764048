"""Turning raw bytes from `job.submitted` into a job spec, or into a precise reason it is not one.

Used by the queue (authoritative) and the gateway (early, friendly 422s). Pure: no policy, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from schemas.bounds import (
    JOB_ID_PATTERN,
    MAX_SUBMISSION_BYTES,
    NAME_PATTERN,
    WireError,
    parse_json,
)
from schemas.envelope import Envelope
from schemas.events import RejectReason
from schemas.job import JobSpec
from schemas.registry import upcast

SUBMISSION_TYPE = "JobSubmitted"


@dataclass(frozen=True)
class Submission:
    envelope: Envelope
    spec: JobSpec
    bare: bool = False  # a plain job spec without envelope: it carries no event id of its own


@dataclass(frozen=True)
class Unparseable:
    """A message that is not a job spec. `job_id` is set when one could still be recovered."""

    reason: RejectReason
    message: str
    job_id: str | None = None
    tenant: str | None = None
    idempotency_key: str | None = None


def parse_submission(raw: bytes) -> Submission | Unparseable:
    """Accept either a full envelope (`type` + `payload`) or a bare job spec object."""
    try:
        doc = parse_json(raw, max_bytes=MAX_SUBMISSION_BYTES)
    except WireError as exc:
        return Unparseable(RejectReason(exc.reason), str(exc))
    if not isinstance(doc, dict):
        return Unparseable(
            RejectReason.MALFORMED, f"message must be a JSON object, got {type(doc).__name__}"
        )
    is_envelope = "payload" in doc and "type" in doc
    body: Any = doc.get("payload") if is_envelope else doc
    if not isinstance(body, dict):
        return Unparseable(RejectReason.MALFORMED, "envelope payload must be a JSON object")
    recovered = _recover_ids(body)
    if is_envelope and doc.get("type") != SUBMISSION_TYPE:
        kind = str(doc.get("type"))[:64]
        return Unparseable(
            RejectReason.MALFORMED,
            f"an envelope of type {kind!r} is not a job submission; job.submitted takes "
            f"{SUBMISSION_TYPE} envelopes or a bare job spec",
            job_id=recovered.job_id,
            tenant=recovered.tenant,
            idempotency_key=recovered.idempotency_key,
        )
    try:
        envelope = (
            Envelope.model_validate(doc)
            if is_envelope
            else Envelope(type=SUBMISSION_TYPE, payload=body, tenant=recovered.tenant)
        )
        envelope = upcast(envelope)
        spec = JobSpec.model_validate(envelope.payload)
    except ValueError as exc:  # pydantic's ValidationError, or an upcaster's complaint
        text = describe_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)
        return Unparseable(
            RejectReason.INVALID_SPEC,
            text,
            job_id=recovered.job_id,
            tenant=recovered.tenant,
            idempotency_key=recovered.idempotency_key,
        )
    return Submission(envelope, spec, bare=not is_envelope)


@dataclass(frozen=True)
class _Ids:
    job_id: str | None
    tenant: str | None
    idempotency_key: str | None


_RECOVERABLE = {
    "job_id": re.compile(JOB_ID_PATTERN),
    "tenant": re.compile(NAME_PATTERN),
    "idempotency_key": re.compile(r"^[!-~]{1,256}$"),
}


def _recover_ids(body: dict[str, Any]) -> _Ids:
    """Ids to answer a refused submission under: only values that are valid ids themselves,
    so a rejection never carries (and no store is asked to keep) what made the spec bad."""

    def text(name: str) -> str | None:
        value = body.get(name)
        ok = isinstance(value, str) and _RECOVERABLE[name].fullmatch(value)
        return value if ok else None

    return _Ids(text("job_id"), text("tenant"), text("idempotency_key"))


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem, naming the field path, e.g. `resources.cpu: Input should be …`."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(message)"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def spec_problems(spec: JobSpec) -> list[tuple[RejectReason, str]]:
    """Checks that need no policy: sizes must be positive."""
    problems: list[tuple[RejectReason, str]] = []
    res = spec.resources
    if spec.replicas < 1:
        problems.append(
            (RejectReason.INVALID_RESOURCES, f"replicas must be at least 1, got {spec.replicas}")
        )
    for name, value in (
        ("resources.accelerators", res.accelerators),
        ("resources.cpu", res.cpu),
        ("resources.memory_gb", res.memory_gb),
    ):
        if value <= 0:
            problems.append(
                (RejectReason.INVALID_RESOURCES, f"{name} must be greater than 0, got {value:g}")
            )
    if res.accelerator_memory_gb is not None and res.accelerator_memory_gb <= 0:
        problems.append(
            (
                RejectReason.INVALID_RESOURCES,
                f"resources.accelerator_memory_gb must be greater than 0, got "
                f"{res.accelerator_memory_gb:g}",
            )
        )
    return problems
