"""The scheduler's feed never stops on a record: one it cannot read, or that its state cannot
apply, is skipped (logged, counted; the topic's owning consumer dead-letters it) and the rest
of its batch is applied, in order."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from aiokafka import ConsumerRecord, TopicPartition
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import JobFinished, Outcome
from services.scheduler.feed import Feed
from services.scheduler.handlers import FEED_TOPICS, SchedulerMetrics, apply_records
from services.scheduler.state import SchedulerState
from tests.unit.services.test_scheduler_state import capacity, placed, queued


def record(topic: str, value: bytes | None, offset: int = 0) -> ConsumerRecord[Any, Any]:
    size = len(value) if value is not None else 0
    return ConsumerRecord(topic, 0, offset, 0, 0, None, value, None, 0, size, ())


def wire(topic: str, event_type: str, payload: Any) -> ConsumerRecord[Any, Any]:
    body = payload if isinstance(payload, dict) else payload.model_dump(mode="json")
    env = Envelope(type=event_type, payload=body)
    return record(topic, env.model_dump_json().encode())


def bad_batch() -> list[ConsumerRecord[Any, Any]]:
    """Good records with three unreadable ones between them; later records depend on earlier
    ones (a placement needs its job, a finish ends it), so order matters."""
    return [
        wire(topics.CLUSTER_CAPACITY, "ClusterCapacity", capacity(1)),
        record(topics.JOB_QUEUED, b"\xff{not json"),
        wire(topics.JOB_QUEUED, "JobQueued", queued("j1")),
        wire(topics.JOB_QUEUED, "JobQueued", {"job_id": "j9"}),  # a valid envelope, no spec
        record(topics.PLACEMENT_DECIDED, None),  # a tombstone
        wire(topics.PLACEMENT_DECIDED, "PlacementDecided", placed("j1")),
        wire(topics.JOB_QUEUED, "JobQueued", queued("j2")),
        wire(
            topics.JOB_FINISHED, "JobFinished", JobFinished(job_id="j2", outcome=Outcome.CANCELED)
        ),
    ]


def applied_well(state: SchedulerState) -> bool:
    return (
        list(state.nodes) == ["n0"]
        and list(state.running) == ["j1"]
        and state.pending == {}
        and "j2" in state.finished
        and "j9" not in state.queued
    )


def test_unreadable_records_are_skipped_and_the_rest_applied_in_order() -> None:
    state = SchedulerState()
    registry = CollectorRegistry()
    with capture_logs() as logs:
        apply_records(state, bad_batch(), SchedulerMetrics(registry))
    assert applied_well(state)
    assert registry.get_sample_value("qm_scheduler_bad_records_total") == 3
    assert [e["event"] for e in logs].count("skipping unreadable record") == 3


def test_a_record_the_state_cannot_apply_is_skipped_with_its_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = SchedulerState()
    on_queued = state.on_queued

    def broken_for_j3(event: Any) -> None:
        if event.job_id == "j3":
            raise KeyError("a bug the record provokes")
        on_queued(event)

    monkeypatch.setattr(state, "on_queued", broken_for_j3)
    batch = bad_batch()
    batch.insert(3, wire(topics.JOB_QUEUED, "JobQueued", queued("j3")))
    registry = CollectorRegistry()
    with capture_logs() as logs:
        apply_records(state, batch, SchedulerMetrics(registry))
    assert applied_well(state) and "j3" not in state.queued
    assert registry.get_sample_value("qm_scheduler_bad_records_total") == 4
    [failed] = [e for e in logs if e["event"] == "skipping a record the state could not apply"]
    assert failed["exc_info"] is True and failed["log_level"] == "error"


class FakeConsumer:
    """Hands out the given batches, then nothing."""

    def __init__(self, batches: list[list[ConsumerRecord[Any, Any]]]) -> None:
        self.batches = batches

    async def getmany(self, **_kwargs: Any) -> dict[TopicPartition, list[Any]]:
        if not self.batches:
            await asyncio.sleep(0.01)
            return {}
        records = self.batches.pop(0)
        return {TopicPartition(records[0].topic, 0): records}


async def test_the_feed_goes_on_after_a_batch_with_bad_records() -> None:
    state = SchedulerState()
    metrics = SchedulerMetrics(CollectorRegistry())
    feed = Feed("unused:9092", FEED_TOPICS, 10, lambda rs: apply_records(state, rs, metrics))
    feed._consumers = [
        FakeConsumer([bad_batch(), [wire(topics.JOB_QUEUED, "JobQueued", queued("j4"))]])
    ]
    feed.caught_up.set()
    task = asyncio.create_task(feed.run())
    try:
        async with asyncio.timeout(5):
            while "j4" not in state.pending:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert not task.done()
        assert "j1" in state.running and feed.records == 9
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
