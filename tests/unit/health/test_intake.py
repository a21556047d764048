"""Reading job.progress at the edge: good reports become `Progress`, unusable ones are
dead-lettered with a reason and the rest of the batch goes on."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import ConsumerRecord

from schemas import topics
from schemas.envelope import Envelope
from services.health.intake import TOPICS, read_batch
from tests.unit.health.builders import at


def record(payload: dict[str, Any], offset: int = 0) -> ConsumerRecord[Any, Any]:
    value = Envelope(type="JobProgress", producer="t", payload=payload).model_dump_json().encode()
    return ConsumerRecord(
        topics.JOB_PROGRESS, 0, offset, 0, 0, None, value, None, 0, len(value), ()
    )


def report(*steps: float, replicas: list[int] | None = None) -> dict[str, Any]:
    numbers = replicas if replicas is not None else list(range(len(steps)))
    return {
        "job_id": "job-1",
        "attempt": 1,
        "cluster": "g",
        "replicas": [
            {"replica": i, "node_id": f"g-{i}", "step_time_s": s}
            for i, s in zip(numbers, steps, strict=True)
        ],
    }


def test_the_health_service_consumes_job_progress() -> None:
    assert topics.JOB_PROGRESS in TOPICS


def test_a_good_report_becomes_progress() -> None:
    batch = read_batch((record(report(1.0, 3.0)),), at(100))
    [p] = batch.progress
    assert (p.job_id, p.attempt, p.cluster) == ("job-1", 1, "g")
    assert [(r.replica, r.node_id, r.step_time_s) for r in p.replicas] == [
        (0, "g-0", 1.0),
        (1, "g-1", 3.0),
    ]
    assert batch.dead == []


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (report(1.0, -2.0), "replicas.1.step_time_s: must be a number > 0"),
        (report(0.0, 1.0), "replicas.0.step_time_s: must be a number > 0"),
        (report(1.0, 1.0, replicas=[3, 3]), "replicas: replica numbers repeat"),
        ({"job_id": "job-1", "attempt": 1, "cluster": "g"}, "replicas: Field required"),
    ],
)
def test_an_unusable_report_is_dead_lettered_and_the_batch_goes_on(
    payload: dict[str, Any], error: str
) -> None:
    batch = read_batch((record(payload, 0), record(report(1.0, 1.0), 1)), at(100))
    [dead] = batch.dead
    assert dead.topic == topics.DEAD_LETTER
    assert dead.envelope.payload["error"].startswith(error)
    assert dead.envelope.payload["source_topic"] == topics.JOB_PROGRESS
    assert len(batch.progress) == 1
