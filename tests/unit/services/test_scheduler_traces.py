"""The scheduler's hop of a job's trace: from the feed reading a traced `job.queued` to the
broker acknowledging its placement, one `scheduler.place` span per job, child of the queue's
span, its context on the placement; a placement that did not go out fails its span and is
traced again when decided again; untraced or poisoned records are simply not traced."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from aiokafka.errors import RequestTimedOutError
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from schemas import topics
from services.common.tracing import Tracing
from services.scheduler import traces
from services.scheduler.cycle import Cycle
from services.scheduler.errors import PublishFailed
from services.scheduler.handlers import SchedulerMetrics
from services.scheduler.traces import Waiting
from tests.unit.services.builders import checked
from tests.unit.services.test_scheduler_cycle import fleet_with
from tests.unit.services.test_scheduler_preemption import NOW, POLICY, SCALE

QUEUE_SPAN = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Acks:
    """A broker that takes every message, failing the jobs in `lost`, and keeps the headers."""

    def __init__(self, lost: set[str]) -> None:
        self.lost = lost
        self.headers: dict[str, dict[str, str]] = {}

    async def publish(self, body: bytes, topic: str, **kwargs: Any) -> asyncio.Future[None]:
        job_id = json.loads(body)["payload"].get("job_id")
        if topic == topics.PLACEMENT_DECIDED:
            self.headers[job_id] = dict(kwargs.get("headers") or {})
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if job_id in self.lost:
            answer.set_exception(RequestTimedOutError())
        else:
            answer.set_result(None)
        return answer


def queued_record(job_id: str, headers: Any) -> ConsumerRecord[Any, Any]:
    return ConsumerRecord(
        topics.JOB_QUEUED, 0, 0, 0, 0, job_id.encode(), b"{}", None, 0, 2, headers
    )


async def test_a_traced_job_gets_one_span_from_arrival_to_acknowledged_placement() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    state = fleet_with(4, "traced", "plain", "poisoned", "lost")
    waiting = Waiting(Tracing(provider, "scheduler"), state)
    waiting.note(
        [
            queued_record("traced", [("traceparent", QUEUE_SPAN.encode())]),
            queued_record("plain", []),
            queued_record("poisoned", [("traceparent", b"\xff" * 9000), ("traceparent", None)]),
            queued_record("lost", [("traceparent", QUEUE_SPAN.encode())]),
        ]
    )
    assert set(waiting.jobs) == {"traced", "lost"}
    broker = Acks(lost={"lost"})
    cycle = Cycle(
        state,
        POLICY,
        broker,  # type: ignore[arg-type]
        SchedulerMetrics(CollectorRegistry()),
        "leader-1",
        SCALE,
        checked(),
        waiting=waiting,
    )
    with pytest.raises(PublishFailed):  # the lost one: decided again on the next cycle
        await cycle.run_once(epoch=1, now=NOW)
    assert set(broker.headers) == {"traced", "plain", "poisoned", "lost"}
    assert "traceparent" not in broker.headers["plain"]
    assert "traceparent" not in broker.headers["poisoned"]

    spans = {s.attributes["qm.job_id"]: s for s in exporter.get_finished_spans()}  # type: ignore[index]
    assert set(spans) == {"traced", "lost"}
    placed = spans["traced"]
    assert placed.name == "scheduler.place"
    assert placed.parent is not None and f"{placed.parent.span_id:016x}" == QUEUE_SPAN[36:52]
    assert [e.name for e in placed.events] == ["cycle.start"]
    ctx = placed.context
    assert broker.headers["traced"]["traceparent"][:52] == (
        f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}"
    )
    assert spans["lost"].status.status_code.name == "ERROR"
    assert placed.status.status_code.name != "ERROR"
    # Placed: forgotten. Not acknowledged: still waiting, traced again on the next try.
    assert set(waiting.jobs) == {"lost"}


def test_a_requeue_without_a_trace_drops_the_old_context() -> None:
    provider = TracerProvider()
    state = fleet_with(1, "j1")
    waiting = Waiting(Tracing(provider, "scheduler"), state)
    waiting.note([queued_record("j1", [("traceparent", QUEUE_SPAN.encode())])])
    waiting.note([queued_record("j1", [])])
    assert waiting.jobs == {}


def test_with_tracing_off_nothing_is_kept() -> None:
    waiting = Waiting(None, fleet_with(1, "j1"))
    waiting.note([queued_record("j1", [("traceparent", QUEUE_SPAN.encode())])])
    assert waiting.jobs == {}


def test_a_standby_that_never_places_keeps_a_bounded_map() -> None:
    """A standby notes every traced job.queued but never places: its map must not grow with
    every job that ever went by, yet keep the jobs a leader would still place."""
    state = fleet_with(1, "still-pending")  # the jobs noted below went (placed elsewhere)
    waiting = Waiting(Tracing(TracerProvider(), "scheduler"), state)
    header = [("traceparent", QUEUE_SPAN.encode())]
    waiting.note([queued_record("still-pending", header)])
    for batch in range(50):
        waiting.note([queued_record(f"gone-{batch}-{i}", header) for i in range(100)])
        assert len(waiting.jobs) <= len(state.pending) + traces.SLACK + 100
    assert "still-pending" in waiting.jobs
    assert "gone-49-99" in waiting.jobs  # this batch's entries: not applied to the state yet


def test_past_the_cap_the_oldest_entries_go_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traces, "MAX_WAITING", 3)
    names = [f"j{i}" for i in range(5)]
    state = fleet_with(1, *names)  # all pending: only the cap bounds the map
    waiting = Waiting(Tracing(TracerProvider(), "scheduler"), state)
    header = [("traceparent", QUEUE_SPAN.encode())]
    waiting.note([queued_record(n, header) for n in names[:3]])
    waiting.note([queued_record("j0", header)])  # requeued: now the newest
    waiting.note([queued_record(n, header) for n in names[3:]])
    assert list(waiting.jobs) == ["j1", "j2", "j0", "j3", "j4"]  # this batch not pruned yet
    waiting.note([])
    assert list(waiting.jobs) == ["j0", "j3", "j4"]
