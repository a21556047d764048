"""A job's trace spans every service it went through: submitted over REST, its spans from the
gateway, the queue, the scheduler and the executor form one trace, each hop the child of the
one before; a job written straight to Kafka (with no trace context, or a poisoned one) starts
its trace at the queue. Read from the JSON lines files the stack writes (QM_TRACE_DIR, set by
tests/conftest.py), and shown by `qm trace`."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from click.testing import CliRunner

from cli.main import app as qm
from cli.stack import Stack
from cli.traces import Span, read_spans, traces_of
from schemas import topics
from tests.integration.kafka_tools import START_S, STOP_S, bounded

ADMIN = {"Authorization": "Bearer dev-admin"}
HOPS = ("gateway.submit", "queue.admit", "scheduler.place", "executor.start")
JOB = {
    "tenant": "vision",
    "name": "traced",
    "resources": {"accelerators": 1, "accelerator_types": ["H100", "A100"]},
    "labels": {"sim_duration_s": "60"},
}


def trace_dir(stack: Stack) -> Path:
    return stack.state_dir / "traces"


async def spans_of(stack: Stack, job_id: str, names: tuple[str, ...]) -> list[Span]:
    """The job's spans once every hop in `names` has been written (files are written about
    every half second by each service), or what there is after 60 s."""
    found: list[Span] = []
    for _ in range(120):
        traces = traces_of(read_spans(trace_dir(stack)), job_id)
        found = [s for spans in traces.values() for s in spans]
        if set(names) <= {s.name for s in found}:
            break
        await asyncio.sleep(0.5)
    return found


async def wait_state(client: httpx.AsyncClient, job_id: str, states: set[str]) -> str:
    state = "?"
    for _ in range(120):
        r = await client.get(f"/v1/jobs/{job_id}", headers=ADMIN)
        if r.status_code == 200:
            state = r.json()["state"]
            if state in states:
                break
        await asyncio.sleep(0.5)
    return state


def by_name(spans: list[Span]) -> dict[str, Span]:
    named: dict[str, Span] = {}
    for span in spans:
        assert span.name not in named, f"two {span.name} spans: {spans}"
        named[span.name] = span
    return named


@pytest.fixture(scope="module")
async def client(qm_stack: Stack) -> Any:
    async with httpx.AsyncClient(base_url=qm_stack.gateway_url, timeout=30) as c:
        yield c


async def test_a_submitted_job_is_one_trace_through_every_service(
    qm_stack: Stack, client: httpx.AsyncClient
) -> None:
    r = await client.post("/v1/jobs", json=JOB, headers=ADMIN)
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    assert await wait_state(client, job_id, {"running", "succeeded"}) in {"running", "succeeded"}

    spans = await spans_of(qm_stack, job_id, HOPS)
    hop = by_name([s for s in spans if s.name in HOPS])
    assert set(hop) == set(HOPS)
    assert len({s.trace_id for s in spans}) == 1
    assert {hop[n].service.split("/")[0] for n in HOPS} == {
        "gateway",
        "queue",
        "scheduler",
        "executor",
    }
    # Each hop is the child of the one before it; the gateway's starts the trace.
    assert hop["gateway.submit"].parent_id is None
    assert hop["queue.admit"].parent_id == hop["gateway.submit"].span_id
    assert hop["scheduler.place"].parent_id == hop["queue.admit"].span_id
    assert hop["executor.start"].parent_id == hop["scheduler.place"].span_id
    for name in HOPS:
        assert hop[name].attributes["qm.job_id"] == job_id
        assert hop[name].status != "error"
    assert hop["scheduler.place"].event_ns("cycle.start") is not None
    assert hop["queue.admit"].attributes["qm.emitted"] == ["JobQueued"]
    assert hop["executor.start"].attributes["qm.emitted"] == ["JobStarted"]

    shown = CliRunner().invoke(qm, ["trace", job_id, "--dir", str(trace_dir(qm_stack))])
    assert shown.exit_code == 0, shown.output
    assert "4 services (executor, gateway, queue, scheduler)" in shown.output
    assert "for the cycle that placed it" in shown.output


async def test_a_job_written_to_kafka_starts_its_trace_at_the_queue(
    qm_stack: Stack, client: httpx.AsyncClient
) -> None:
    run = uuid.uuid4().hex[:6]
    plain, poisoned = f"plain-{run}", f"poisoned-{run}"
    producer = AIOKafkaProducer(bootstrap_servers=qm_stack.server("kafka").url)
    await bounded(producer.start(), START_S, "a test producer's start")
    try:
        await producer.send_and_wait(
            topics.JOB_SUBMITTED,
            json.dumps({**JOB, "job_id": plain}).encode(),
            key=plain.encode(),
        )
        # A trace context no one could continue: not a traceparent, not even UTF-8.
        hostile = [
            ("traceparent", b"\xff\xfe-not-a-trace" * 100),
            ("traceparent", b"00-" + b"0" * 32 + b"-" + b"0" * 16 + b"-01"),
        ]
        await producer.send_and_wait(
            topics.JOB_SUBMITTED,
            json.dumps(
                {
                    "type": "JobSubmitted",
                    "traceparent": "garbage",
                    "payload": {**JOB, "job_id": poisoned},
                }
            ).encode(),
            key=poisoned.encode(),
            headers=hostile,
        )
    finally:
        await bounded(producer.stop(), STOP_S, "a test producer's stop")

    for job_id in (plain, poisoned):
        assert await wait_state(client, job_id, {"running", "succeeded"}) in {
            "running",
            "succeeded",
        }
        spans = await spans_of(qm_stack, job_id, HOPS[1:])
        hop = by_name(spans)
        assert set(hop) == set(HOPS[1:]), job_id
        assert len({s.trace_id for s in spans}) == 1
        assert hop["queue.admit"].parent_id is None
        assert hop["scheduler.place"].parent_id == hop["queue.admit"].span_id
        assert hop["executor.start"].parent_id == hop["scheduler.place"].span_id
