"""Reading raw records into the preemptor's requests, job facts and run ends; bad input is
dead-lettered with the reason."""

from __future__ import annotations

from typing import Any

from aiokafka import ConsumerRecord

from schemas import topics
from schemas.envelope import Envelope
from services.preemptor.guards import JobFacts
from services.preemptor.intake import RunEnd, read_batch
from tests.unit.preemptor.builders import T0, wall, wire_request


def record(topic: str, value: bytes | dict[str, Any], offset: int = 0) -> ConsumerRecord[Any, Any]:
    if isinstance(value, dict):
        event_type, payload = value.pop("type"), value
        value = (
            Envelope(type=event_type, occurred_at=T0, payload=payload).model_dump_json().encode()
        )
    return ConsumerRecord(topic, 0, offset, 0, 0, b"k", value, None, 0, len(value), ())


def started(job_id: str, attempt: int, ran_s: float = 0) -> dict[str, Any]:
    at = (T0 - wall(ran_s)).isoformat()
    return {
        "type": "JobStarted",
        "job_id": job_id,
        "attempt": attempt,
        "cluster": "c1",
        "nodes": ["n1"],
        "started_at": at,
    }


def test_a_batch_becomes_requests_facts_and_ends() -> None:
    batch = read_batch(
        (
            record(topics.PREEMPTION_REQUESTED, {"type": "PreemptionRequested", **wire_request()}),
            record(topics.JOB_STARTED, started("victim", 1, ran_s=600)),
            record(topics.JOB_STARTED, started("victim", 2)),
            record(topics.JOB_STARTED, started("victim", 1, ran_s=600)),  # late, older run
            record(
                topics.JOB_FINISHED,
                {"type": "JobFinished", "job_id": "asker", "outcome": "canceled"},
            ),
            record(
                topics.JOB_PREEMPTED,
                {
                    "type": "JobPreempted",
                    "job_id": "victim",
                    "attempt": 1,
                    "cluster": "c1",
                    "reason_code": "preempted_for_priority",
                    "message": "m",
                },
            ),
        )
    )
    assert batch.dead == []
    [got] = batch.requests
    assert got.request.claim == (0, False, 0) and got.request.for_claim == (50, True, 0)
    assert got.request.requested_at == T0 and got.request.id == got.envelope.event_id
    assert batch.facts["victim"] == JobFacts("victim", 2, T0, 1, placed_at=T0)
    assert batch.facts["asker"] == JobFacts("asker", finished=True, closed=True)
    assert batch.ends == [
        RunEnd("asker", None, topics.JOB_FINISHED),
        RunEnd("victim", 1, topics.JOB_PREEMPTED),
    ]


def test_placements_carry_the_epoch_and_the_preemptible_flag() -> None:
    placement = {
        "type": "PlacementDecided",
        "job_id": "victim",
        "attempt": 1,
        "epoch": 9,
        "leader": "s",
        "cluster": "c1",
        "accelerator_type": "H100",
        "replicas": [],
        "spec": {"tenant": "vision", "preemptible": False},
    }
    batch = read_batch((record(topics.PLACEMENT_DECIDED, placement),))
    assert batch.epoch == 9
    assert batch.facts["victim"] == JobFacts("victim", placed_at=T0, preemptible=False)


def test_unreadable_records_are_dead_lettered_with_the_reason() -> None:
    missing = wire_request()
    del missing["for_claim"]
    batch = read_batch(
        (
            record(topics.PREEMPTION_REQUESTED, b"{not json", 0),
            record(topics.PREEMPTION_REQUESTED, {"type": "PreemptionRequested", **missing}, 1),
            record(topics.JOB_STARTED, {"type": "JobStarted", "job_id": "x"}, 2),
            record(
                topics.PREEMPTION_REQUESTED, {"type": "PreemptionRequested", **wire_request()}, 3
            ),
        )
    )
    assert len(batch.requests) == 1  # the good one after the bad ones is still read
    errors = [d.envelope.payload for d in batch.dead]
    assert [e["offset"] for e in errors] == [0, 1, 2]
    assert {e["consumer"] for e in errors} == {"preemptor"}
    assert "for_claim" in errors[1]["error"]
    assert "attempt" in errors[2]["error"]
    assert all(d.topic == topics.DEAD_LETTER for d in batch.dead)


def test_naive_times_are_taken_as_utc() -> None:
    naive = started("victim", 1)
    naive["started_at"] = T0.replace(tzinfo=None).isoformat()
    batch = read_batch((record(topics.JOB_STARTED, naive),))
    assert batch.facts["victim"].started_at == T0
