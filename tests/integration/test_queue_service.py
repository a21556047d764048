"""The queue on the real broker and PostgreSQL: raw JSON from another platform, bad input,
redelivery and cancel."""

from __future__ import annotations

import json
import uuid
from typing import Any

from schemas import topics
from schemas.envelope import Envelope
from services.queue.app import create_app
from services.queue.settings import QueueSettings
from tests.integration.conftest import running
from tests.integration.kafka_tools import collect, produce

OUT = (
    topics.JOB_QUEUED,
    topics.JOB_REJECTED,
    topics.DEAD_LETTER,
    topics.JOB_FINISHED,
    topics.JOB_STOP_ORDERED,
)


def spec(job_id: str, **fields: Any) -> bytes:
    return json.dumps({"job_id": job_id, "tenant": "vision", **fields}).encode()


def mentions(run: str):  # type: ignore[no-untyped-def]
    def keep(_topic: str, env: dict[str, Any]) -> bool:
        return run in json.dumps(env)

    return keep


async def test_raw_json_jobs_and_every_kind_of_bad_input(service_env: dict[str, Any]) -> None:
    run = uuid.uuid4().hex[:8]
    j = {
        name: f"{run}-{name}"
        for name in (
            "good",
            "envelope",
            "types",
            "tenant",
            "queue",
            "accel",
            "zero",
            "negative",
            "gang",
            "after",
        )
    }
    envelope = Envelope(
        type="JobSubmitted", payload={"job_id": j["envelope"], "tenant": "nlp"}
    ).model_dump_json()
    messages = [
        (j["good"], spec(j["good"], replicas=2, resources={"accelerators": 8})),
        (j["envelope"], envelope.encode()),
        (None, f"{{not json {run}".encode()),
        (j["types"], spec(j["types"], replicas="lots")),
        (j["tenant"], spec(j["tenant"], tenant="ghosts")),
        (j["queue"], spec(j["queue"], queue="express")),
        (j["accel"], spec(j["accel"], resources={"accelerator_types": ["B200"]})),
        (j["zero"], spec(j["zero"], resources={"accelerators": 0})),
        (j["negative"], spec(j["negative"], replicas=-2)),
        (j["gang"], spec(j["gang"], replicas=9)),
        (j["after"], spec(j["after"])),  # a poison message must not stop the partition
    ]
    app = create_app(QueueSettings(**service_env))
    async with running(app):
        await produce(service_env["kafka_bootstrap"], topics.JOB_SUBMITTED, messages)
        got = await collect(service_env["kafka_bootstrap"], OUT, mentions(run), count=12)

    def outcome(job_id: str) -> tuple[str, str | None]:
        for topic, env in got:
            if env["payload"].get("job_id") == job_id and topic != topics.DEAD_LETTER:
                return topic, env["payload"].get("reason_code")
        return "missing", None

    assert outcome(j["good"]) == (topics.JOB_QUEUED, None)
    assert outcome(j["envelope"]) == (topics.JOB_QUEUED, None)
    assert outcome(j["after"]) == (topics.JOB_QUEUED, None)
    assert outcome(j["types"]) == (topics.JOB_REJECTED, "invalid_spec")
    assert outcome(j["tenant"]) == (topics.JOB_REJECTED, "unknown_tenant")
    assert outcome(j["queue"]) == (topics.JOB_REJECTED, "unknown_queue")
    assert outcome(j["accel"]) == (topics.JOB_REJECTED, "unknown_accelerator_type")
    assert outcome(j["zero"]) == (topics.JOB_REJECTED, "invalid_resources")
    assert outcome(j["negative"]) == (topics.JOB_REJECTED, "invalid_resources")
    assert outcome(j["gang"]) == (topics.JOB_REJECTED, "gang_too_large")
    dead = [env["payload"] for topic, env in got if topic == topics.DEAD_LETTER]
    assert sorted(d["error"].split(":")[0] for d in dead) == ["invalid_spec", "malformed"]
    assert all(d["source_topic"] == topics.JOB_SUBMITTED for d in dead)


async def test_duplicates_are_absorbed_and_cancel_finishes_a_queued_job(
    service_env: dict[str, Any],
) -> None:
    run = uuid.uuid4().hex[:8]
    job_id = f"{run}-dup"
    envelope = (
        Envelope(type="JobSubmitted", payload={"job_id": job_id, "tenant": "vision"})
        .model_dump_json()
        .encode()
    )
    twin = spec(f"{run}-twin", idempotency_key=f"key-{run}")
    app = create_app(QueueSettings(**service_env))
    async with running(app):
        # The same envelope twice (a producer retry) and a second job with a used key.
        await produce(
            service_env["kafka_bootstrap"],
            topics.JOB_SUBMITTED,
            [
                (job_id, envelope),
                (job_id, envelope),
                (f"{run}-a", spec(f"{run}-a", idempotency_key=f"key-{run}")),
                (f"{run}-twin", twin),
            ],
        )
        first = await collect(service_env["kafka_bootstrap"], OUT, mentions(run), count=3)
        cancel = Envelope(
            type="JobCancelRequested", payload={"job_id": job_id, "requested_by": "test"}
        )
        await produce(
            service_env["kafka_bootstrap"],
            topics.JOB_CANCEL_REQUESTED,
            [(job_id, cancel.model_dump_json().encode())],
        )
        after = await collect(service_env["kafka_bootstrap"], OUT, mentions(run), count=5)
    queued = [env["payload"]["job_id"] for topic, env in first if topic == topics.JOB_QUEUED]
    # The two jobs sharing a key sit on different partitions: whichever came first wins.
    assert job_id in queued and len(queued) == 2
    winner = next(q for q in queued if q != job_id)
    rejected = [env["payload"] for topic, env in first if topic == topics.JOB_REJECTED]
    assert [r["reason_code"] for r in rejected] == ["duplicate_submission"]
    assert winner in rejected[0]["message"] and rejected[0]["job_id"] != winner
    finished = [env["payload"] for topic, env in after if topic == topics.JOB_FINISHED]
    assert [(f["job_id"], f["outcome"]) for f in finished] == [(job_id, "canceled")]
    stops = [env["payload"]["job_id"] for topic, env in after if topic == topics.JOB_STOP_ORDERED]
    assert stops == [job_id]
