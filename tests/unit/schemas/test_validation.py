"""Raw `job.submitted` bytes: each kind of bad input gets its own reason."""

from __future__ import annotations

import json

import pytest

from schemas.envelope import Envelope
from schemas.events import RejectReason
from schemas.job import JobSpec
from schemas.registry import _UPCASTERS, CURRENT_VERSION, register_upcaster, upcast
from schemas.validation import Submission, Unparseable, parse_submission, spec_problems


def raw(doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_bare_spec_is_a_submission() -> None:
    got = parse_submission(raw({"tenant": "vision", "replicas": 2, "unknown_field": 1}))
    assert isinstance(got, Submission)
    assert got.bare and got.spec.replicas == 2 and got.envelope.tenant == "vision"


def test_envelope_keeps_its_event_id() -> None:
    env = Envelope(type="JobSubmitted", payload={"tenant": "nlp"})
    got = parse_submission(env.model_dump_json().encode())
    assert isinstance(got, Submission)
    assert not got.bare and got.envelope.event_id == env.event_id


@pytest.mark.parametrize(
    ("body", "reason", "fragment", "job_id"),
    [
        (b"{not json", RejectReason.MALFORMED, "not valid JSON", None),
        (b"[1, 2]", RejectReason.MALFORMED, "JSON object", None),
        (raw({"type": "JobSubmitted", "payload": 3}), RejectReason.MALFORMED, "payload", None),
        (
            raw({"tenant": "vision", "replicas": "four", "job_id": "j1"}),
            RejectReason.INVALID_SPEC,
            "replicas",
            "j1",
        ),
        (raw({"replicas": 1}), RejectReason.INVALID_SPEC, "tenant", None),
        (
            raw({"tenant": "vision", "resources": {"accelerators": 2.5}}),
            RejectReason.INVALID_SPEC,
            "whole number",
            None,
        ),
    ],
)
def test_bad_messages_say_why(
    body: bytes, reason: RejectReason, fragment: str, job_id: str | None
) -> None:
    got = parse_submission(body)
    assert isinstance(got, Unparseable)
    assert got.reason is reason
    assert fragment in got.message
    assert got.job_id == job_id


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"replicas": 0}, "replicas must be at least 1"),
        ({"replicas": -3}, "replicas must be at least 1"),
        ({"resources": {"accelerators": 0}}, "resources.accelerators"),
        ({"resources": {"cpu": -1}}, "resources.cpu"),
        ({"resources": {"memory_gb": 0}}, "resources.memory_gb"),
        ({"resources": {"accelerator_memory_gb": -8}}, "accelerator_memory_gb"),
    ],
)
def test_non_positive_sizes_are_invalid_resources(
    changes: dict[str, object], fragment: str
) -> None:
    spec = JobSpec.model_validate({"tenant": "vision", **changes})
    problems = spec_problems(spec)
    assert problems and problems[0][0] is RejectReason.INVALID_RESOURCES
    assert fragment in problems[0][1]


def test_a_sane_spec_has_no_problems() -> None:
    assert spec_problems(JobSpec(tenant="vision")) == []


def test_upcaster_lifts_old_payloads() -> None:
    def rename(payload: dict[str, object]) -> dict[str, object]:
        lifted = dict(payload)
        lifted["replicas"] = lifted.pop("gang_size")
        return lifted

    register_upcaster("TestOld", 1, rename)
    try:
        env = Envelope(type="TestOld", version=1, payload={"gang_size": 4})
        lifted = upcast(env)
        assert lifted.version == 2 and lifted.payload == {"replicas": 4}
    finally:
        _UPCASTERS.pop(("TestOld", 1))
        CURRENT_VERSION.pop("TestOld")
