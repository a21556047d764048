"""The queue's handlers, on the in-memory broker and on the real one: raw JSON in, the right
events out, poison dead-lettered without stopping what follows."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import yaml

from schemas import topics
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
