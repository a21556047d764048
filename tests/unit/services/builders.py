"""Readable builders for service-level unit tests."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from aiokafka import ConsumerRecord

from core.policy import Policy
from schemas import topics
from schemas.envelope import Envelope
from schemas.events import PlacementDecided
from schemas.job import JobSpec
from schemas.validation import Submission
from services.scheduler.working import WorkingSet

T0 = datetime(2026, 1, 1, tzinfo=UTC)

POLICY_DOC: dict[str, Any] = {
    "priority_classes": [{"name": "low", "rank": 0}, {"name": "normal", "rank": 10}],
    "accelerator_types": {
        "H100": {"generation": "hopper", "memory_gb": 80, "relative_speed": 3},
        "A100": {"generation": "ampere", "memory_gb": 80, "relative_speed": 1.6},
    },
    "tenants": {
        "vision": {"queues": ["default", "batch"], "max_replicas": 4, "max_accelerators": 32},
        "nlp": {},
    },
}


def policy() -> Policy:
    return Policy.from_dict(POLICY_DOC)


def spec(**fields: Any) -> JobSpec:
    return JobSpec.model_validate({"tenant": "vision", **fields})


def submission(**fields: Any) -> Submission:
    s = spec(**fields)
    env = Envelope(
        type="JobSubmitted", tenant=s.tenant, occurred_at=T0, payload=s.model_dump(mode="json")
    )
    return Submission(env, s)


def event(event_type: str, payload: Any, at: datetime = T0) -> Envelope:
    return Envelope(type=event_type, occurred_at=at, payload=payload.model_dump(mode="json"))


def checked() -> WorkingSet:
    """A scheduler working set compared with a rebuilt one after every cycle's update, raising
    on any difference: every cycle test also checks that the kept state follows the events."""
    return WorkingSet(verify_every=1, strict=True)


def placement_record(
    p: PlacementDecided, spec_json: dict[str, Any], offset: int = 0
) -> ConsumerRecord[Any, Any]:
    """`p` as it comes off `placement.decided`, with `spec_json` for its spec (valid or not)."""
    event = p.model_dump(mode="json") | {"spec": spec_json}
    env = Envelope(type="PlacementDecided", producer="scheduler", payload=event)
    raw = env.model_dump_json().encode()  # one event id: a redelivered copy is the same record
    return ConsumerRecord(
        topics.PLACEMENT_DECIDED, 0, offset, 0, 0, p.job_id.encode(), raw, None, 0, len(raw), []
    )
