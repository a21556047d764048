"""The queue's handlers, on the in-memory broker and on the real one: raw JSON in, the right
events out, poison dead-lettered without stopping what follows, failed runs retried."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import yaml

from schemas import topics
from schemas.envelope import Envelope
from services.queue.app import create_app
from services.queue.settings import QueueSettings
from tests.component.conftest import Harness
from tests.unit.services.builders import POLICY_DOC

ROOT = Path(__file__).resolve().parents[2]
OUT = (topics.JOB_QUEUED, topics.JOB_REJECTED, topics.DEAD_LETTER)


def settings(tmp_path: Path, database_url: str, bootstrap: str | None) -> QueueSettings:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY_DOC))
    return QueueSettings(
        kafka_bootstrap=bootstrap or "127.0.0.1:1",
        database_url=database_url,
        policy_file=policy,
        log_format="console",
    )


async def test_submissions_are_queued_rejected_or_dead_lettered(
    harness: Harness, tmp_path: Path, fresh_database_url: str
) -> None:
    run = uuid.uuid4().hex[:8]
    app = create_app(settings(tmp_path, fresh_database_url, harness.bootstrap))
    harness.capture(app.state.broker, *OUT)

    def spec(name: str, **fields: Any) -> tuple[str, bytes]:
        return name, json.dumps({"job_id": f"{run}-{name}", "tenant": "vision", **fields}).encode()

    async with harness.running(app):
        await harness.publish(
            topics.JOB_SUBMITTED,
            [
                spec("ok", resources={"accelerators": 2}),
                (None, f"<<{run}>> not json".encode()),
                spec("gang", replicas=9),
                spec("after"),
            ],
        )
        got = await harness.wait_for(OUT, lambda _t, env: run in json.dumps(env), count=4)

    by_job = {
        env["payload"].get("job_id"): (topic, env["payload"].get("reason_code"))
        for topic, env in got
        if topic != topics.DEAD_LETTER
    }
    assert by_job[f"{run}-ok"] == (topics.JOB_QUEUED, None)
    assert by_job[f"{run}-after"] == (topics.JOB_QUEUED, None)
    assert by_job[f"{run}-gang"] == (topics.JOB_REJECTED, "gang_too_large")
    dead = [env["payload"] for topic, env in got if topic == topics.DEAD_LETTER]
    assert len(dead) == 1 and "not valid JSON" in dead[0]["error"]
    queued = next(env for topic, env in got if topic == topics.JOB_QUEUED)
    assert queued["payload"]["spec"]["resources"]["accelerators"] in (1, 2)
    assert queued["causation_id"] and queued["trace_id"]


async def test_a_failed_run_is_requeued_with_a_backoff_then_the_job_fails(
    harness: Harness, tmp_path: Path, fresh_database_url: str
) -> None:
    run = uuid.uuid4().hex[:8]
    job_id = f"{run}-flaky"
    app = create_app(settings(tmp_path, fresh_database_url, harness.bootstrap))
    harness.capture(app.state.broker, topics.JOB_QUEUED, topics.JOB_FINISHED)

    def mine(_topic: str, env: dict[str, Any]) -> bool:
        return bool(env["payload"].get("job_id") == job_id)

    def failure(attempt: int) -> tuple[str, bytes]:
        env = Envelope(
            type="RunFailed",
            payload={
                "job_id": job_id,
                "attempt": attempt,
                "cluster": "c1",
                "reason_code": "application_error",
                "message": "exited with code 1",
            },
        )
        return job_id, env.model_dump_json().encode()

    submission = json.dumps({"job_id": job_id, "tenant": "vision", "retry": {"max_retries": 1}})
    async with harness.running(app):
        await harness.publish(topics.JOB_SUBMITTED, [(job_id, submission.encode())])
        await harness.wait_for((topics.JOB_QUEUED,), mine, count=1)
        await harness.publish(topics.JOB_RUN_FAILED, [failure(1)])
        await harness.wait_for((topics.JOB_QUEUED,), mine, count=2)
        await harness.publish(topics.JOB_RUN_FAILED, [failure(2)])
        got = await harness.wait_for((topics.JOB_QUEUED, topics.JOB_FINISHED), mine, count=3)

    queued = [env["payload"] for t, env in got if t == topics.JOB_QUEUED]
    assert [q.get("requeue_of_attempt") for q in queued] == [None, 1]
    assert "not_before" in queued[1]  # the retry waits
    [end] = [env["payload"] for t, env in got if t == topics.JOB_FINISHED]
    assert (end["outcome"], end["reason_code"]) == ("failed", "application_error")
