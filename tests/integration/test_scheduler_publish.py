"""The scheduler's publish on a real broker: each message gets its own outcome, so a cycle
applies what the broker acknowledged and nothing else. (The in-memory test broker hands back
no futures and enforces no limits, so only a real broker shows this.)"""

from __future__ import annotations

import uuid
from typing import Any

from aiokafka.errors import MessageSizeTooLargeError

from schemas import topics
from services.common.kafka import OutMessage, envelope_for, make_broker
from services.scheduler.emit import publish_each
from services.scheduler.settings import SchedulerSettings
from tests.integration.kafka_tools import collect


def explanation(job_id: str, message: str = "behind 3 jobs") -> OutMessage:
    payload = {"job_id": job_id, "codes": ["insufficient_capacity"], "message": message}
    env = envelope_for("PendingExplained", {**payload, "pending_jobs": 1}, producer="scheduler")
    return OutMessage(topics.SCHEDULING_EXPLAINED, job_id, env)


async def test_each_message_gets_its_own_outcome(service_env: dict[str, Any]) -> None:
    broker = make_broker(SchedulerSettings(**service_env), "scheduler-publish-test")
    await broker.connect()
    tag = f"pub-{uuid.uuid4().hex[:8]}"
    try:
        # Bigger than the producer's request limit: refused before it is sent, for good.
        huge = explanation(f"{tag}-huge", "x" * (5 << 20))
        outcomes = await publish_each(
            broker, [explanation(f"{tag}-a"), huge, explanation(f"{tag}-b")]
        )
    finally:
        await broker.stop()
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], MessageSizeTooLargeError)
    found = await collect(
        service_env["kafka_bootstrap"],
        (topics.SCHEDULING_EXPLAINED,),
        lambda _topic, env: str(env["payload"].get("job_id", "")).startswith(tag),
        count=3,
        timeout_s=3.0,
    )
    assert sorted(env["payload"]["job_id"] for _, env in found) == [f"{tag}-a", f"{tag}-b"]
