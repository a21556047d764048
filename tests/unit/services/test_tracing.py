"""Trace context across Kafka (services.common.tracing): read from a record's header or its
envelope, whatever else the record carries (a hostile header is ignored, never fatal); put on
every message caused by a traced event, through the producer and the outbox; one span per
traced job per hop, parented to the context it came with; spans written as JSON lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from faststream.kafka.message import KafkaMessage
from faststream.kafka.parser import AioKafkaBatchParser
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

from schemas import topics
from schemas.envelope import Envelope, parse_envelope
from services.common.consumer import _tolerate_headers
from services.common.kafka import OutMessage, envelope_for
from services.common.outbox import OutboxRelay, row_of
from services.common.settings import ServiceSettings
from services.common.tracing import (
    JsonLinesExporter,
    Tracing,
    header_traceparent,
    hops,
    incoming,
    otlp_traces_url,
    sampled,
    traceparent_in,
)
from services.queue.intake import NewJob, read_batch

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
OTHER = "00-11111111111111111111111111111111-2222222222222222-01"


def record(
    value: bytes = b"{}",
    headers: Any = (),
    topic: str = topics.JOB_SUBMITTED,
    key: bytes | None = b"job-1",
    offset: int = 0,
) -> ConsumerRecord[Any, Any]:
    return ConsumerRecord(
        topic, 0, offset, 1_700_000_000_000, 0, key, value, None, 0, len(value), headers
    )


def traced() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, "test"), exporter


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([("traceparent", PARENT.encode())], PARENT),
        ([("type", b"JobSubmitted"), ("traceparent", PARENT.encode())], PARENT),
        ([(b"traceparent", PARENT)], PARENT),  # a name in bytes, a value in text
        ([], None),
        (None, None),
        ([("traceparent", b"garbage")], None),
        ([("traceparent", PARENT.upper().encode())], None),  # W3C: lowercase hex only
        ([("traceparent", b"\xff\xfe" + PARENT.encode()[2:])], None),  # not UTF-8
        ([("traceparent", PARENT.encode() * 1000)], None),  # huge
        ([("traceparent", None)], None),
        ([("traceparent", 42)], None),
        ([("traceparent", b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01")], None),  # zero trace id
        ([("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-" + b"0" * 16 + b"-01")], None),
        ([("traceparent",), ("a", "b", "c"), 7, None], None),  # not even pairs
        # A poisoned header first does not hide a good one after it.
        ([("traceparent", b"\x00" * 70), ("traceparent", PARENT.encode())], PARENT),
    ],
)
def test_a_header_is_read_only_when_it_is_a_valid_traceparent(
    headers: Any, expected: str | None
) -> None:
    assert header_traceparent(headers) == expected


def test_the_header_wins_over_the_envelope_which_is_the_fallback() -> None:
    env = Envelope(type="JobSubmitted", traceparent=OTHER)
    assert incoming([("traceparent", PARENT.encode())], env) == PARENT
    assert incoming([("traceparent", b"garbage")], env) == OTHER
    assert incoming([], Envelope(type="JobSubmitted")) is None


@pytest.mark.parametrize(
    "value", ["garbage", 42, "", None, ["x"], PARENT + "-extra", PARENT.replace("-01", "-1")]
)
def test_an_envelope_with_an_unusable_traceparent_is_read_without_it(value: Any) -> None:
    # Both parsing paths: pydantic's own, and the strict walk (a non-ASCII tenant forces it).
    for extra in ({}, {"producer": "caf\u00e9-platform"}):
        raw = json.dumps({"type": "JobSubmitted", "traceparent": value, **extra}).encode()
        try:
            env = parse_envelope(raw)
        except ValueError:
            assert extra, "only the producer name may be refused here"
            continue
        assert env.traceparent is None


def test_a_message_carries_its_envelopes_trace_context_as_a_header() -> None:
    env = envelope_for("JobQueued", {"job_id": "j"}, producer="queue")
    assert ("traceparent", PARENT) not in OutMessage(topics.JOB_QUEUED, "j", env).wire()[3]
    env.traceparent = PARENT
    _, _, value, headers, _ = OutMessage(topics.JOB_QUEUED, "j", env).wire()
    assert ("traceparent", PARENT) in headers and ("type", "JobQueued") in headers
    assert json.loads(value)["traceparent"] == PARENT


def test_the_trace_context_is_found_in_a_stored_envelope_but_not_in_its_payload() -> None:
    env = envelope_for("JobQueued", {"labels": {"traceparent": OTHER}}, producer="queue")
    assert traceparent_in(OutMessage("t", "k", env).encode()) is None  # a label is no context
    env.traceparent = PARENT
    assert traceparent_in(OutMessage("t", "k", env).encode()) == PARENT
    assert traceparent_in(b"\xff\x00 not json") is None


class Capturing:
    """FastStream's publish as the outbox relay calls it, keeping what each call carried."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, str]]] = []

    async def publish(self, _body: bytes, topic: str, **kwargs: Any) -> None:
        self.sent.append((topic, dict(kwargs.get("headers") or {})))


async def test_the_outbox_relay_sends_the_trace_context_as_a_header() -> None:
    broker = Capturing()
    relay = OutboxRelay(pool=None, broker=broker, schema="queue")  # type: ignore[arg-type]
    traced_env = envelope_for("JobQueued", {"job_id": "a"}, producer="queue")
    traced_env.traceparent = PARENT
    plain_env = envelope_for("JobQueued", {"job_id": "b"}, producer="queue")
    await relay._publish(
        [
            row_of(OutMessage(topics.JOB_QUEUED, "a", traced_env)),
            row_of(OutMessage(topics.JOB_QUEUED, "b", plain_env)),
        ]
    )
    assert broker.sent == [
        (topics.JOB_QUEUED, {"type": "JobQueued", "traceparent": PARENT}),
        (topics.JOB_QUEUED, {"type": "JobQueued"}),
    ]


def test_a_hop_span_is_a_child_of_the_incoming_context_and_stamps_what_it_caused() -> None:
    tracing, exporter = traced()
    cause = Envelope(type="PlacementDecided", traceparent=PARENT)
    untraced = Envelope(type="PlacementDecided")
    with tracing.hops("executor.start") as hop:
        hop.open(cause.event_id, incoming([], cause), job_id="j1", attempt=1)
        hop.open(untraced.event_id, None, job_id="j2")  # not a root: no span, no context
        out = [
            OutMessage(
                "job.started", "j1", envelope_for("JobStarted", {}, producer="x", cause=cause)
            ),
            OutMessage(
                "job.started", "j2", envelope_for("JobStarted", {}, producer="x", cause=untraced)
            ),
        ]
        hop.stamp(out)
    [span] = exporter.get_finished_spans()
    assert span.name == "executor.start"
    assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT[36:52]
    assert f"{span.context.trace_id:032x}" == PARENT[3:35]
    assert dict(span.attributes or {}) == {
        "qm.job_id": "j1",
        "qm.attempt": 1,
        "qm.emitted": ("JobStarted",),
    }
    assert out[0].envelope.traceparent == (
        f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01"
    )
    assert out[1].envelope.traceparent is None


def test_a_root_hop_starts_a_trace_and_an_unsampled_context_passes_through() -> None:
    tracing, exporter = traced()
    new, unsampled = Envelope(type="JobSubmitted"), Envelope(type="JobSubmitted")
    with tracing.hops("queue.admit", root=True) as hop:
        hop.open(new.event_id, None, job_id="fresh")
        hop.open(unsampled.event_id, UNSAMPLED, job_id="quiet")
        out = [
            OutMessage("q", "fresh", envelope_for("JobQueued", {}, producer="q", cause=new)),
            OutMessage("q", "quiet", envelope_for("JobQueued", {}, producer="q", cause=unsampled)),
        ]
        hop.stamp(out)
    [span] = exporter.get_finished_spans()
    assert span.parent is None and span.attributes is not None
    assert span.attributes["qm.job_id"] == "fresh"
    assert out[0].envelope.traceparent is not None
    assert out[0].envelope.traceparent[3:35] == f"{span.context.trace_id:032x}"
    assert out[1].envelope.traceparent == UNSAMPLED  # the producer's choice holds downstream


def test_a_failed_batch_ends_its_spans_as_errors() -> None:
    tracing, exporter = traced()
    with pytest.raises(RuntimeError), tracing.hops("queue.admit") as hop:
        hop.open("e1", PARENT, job_id="j1")
        raise RuntimeError("database away")
    [span] = exporter.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    assert "database away" in (span.status.description or "")


def test_a_root_sampled_out_builds_no_span_and_tells_downstream_so() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    hop = Tracing(provider, "queue").hops("queue.admit", root=True)
    hop.open("e1", None, job_id="j1")
    message = OutMessage("q", "j1", envelope_for("JobQueued", {}, producer="q"))
    message.envelope.causation_id = "e1"
    hop.stamp([message])
    hop.close()
    assert exporter.get_finished_spans() == ()
    assert message.envelope.traceparent is not None
    assert not sampled(message.envelope.traceparent)


def test_with_tracing_off_nothing_is_built_or_stamped() -> None:
    hop = hops(None, "queue.admit", root=True)
    hop.open("e1", PARENT, job_id="j1")
    message = OutMessage("q", "j1", envelope_for("JobQueued", {}, producer="q"))
    message.envelope.causation_id = "e1"
    hop.stamp([message])
    hop.close()
    assert message.envelope.traceparent is None and not hop
    assert Tracing.configure("queue", ServiceSettings()) is None


def test_the_queue_reads_a_submission_whatever_its_headers_hold() -> None:
    spec = {
        "job_id": "j1",
        "tenant": "vision",
        "resources": {"accelerators": 1, "accelerator_types": ["H100"]},
    }
    body = json.dumps(spec).encode()
    hostile = [
        ("traceparent", b"\xff" * 5000),
        ("traceparent", None),
        (None, b"x"),
        ("traceparent", b"00-zz"),
    ]
    items, dead = read_batch(
        (
            record(body, hostile, offset=0),
            record(body, [("traceparent", PARENT.encode())], key=b"j1", offset=1),
            record(json.dumps({**spec, "job_id": "j2"}).encode(), None, offset=2),
        )
    )
    assert dead == []
    assert [(i.job_id, i.traceparent) for i in items if isinstance(i, NewJob)] == [
        ("j1", None),
        ("j1", PARENT),
        ("j2", None),
    ]


def test_spans_are_written_as_json_lines_and_rotated(tmp_path: Path) -> None:
    settings = ServiceSettings(trace_dir=str(tmp_path))
    tracing = Tracing.configure("executor/edge-a", settings)
    assert tracing is not None
    with tracing.started("gateway.submit", job_id="j1", tenant="vision") as traceparent:
        pass
    with tracing.hops("executor.start") as hop:
        hop.open("e1", traceparent, job_id="j1")
    tracing.shutdown()  # writes what is queued
    [file] = list(tmp_path.glob("*.jsonl"))
    assert file.name.startswith("executor-edge-a.")
    lines = [json.loads(line) for line in file.read_text().splitlines()]
    assert [r["name"] for r in lines] == ["gateway.submit", "executor.start"]
    root, hop_span = lines
    assert root["service"] == "executor" and root["instance"] == "edge-a"
    assert root["parent_id"] is None and hop_span["parent_id"] == root["span_id"]
    assert hop_span["trace_id"] == root["trace_id"] == traceparent[3:35]
    assert root["attributes"] == {"qm.job_id": "j1", "qm.tenant": "vision"}
    assert hop_span["end_ns"] >= hop_span["start_ns"] > 0

    small = JsonLinesExporter(tmp_path / "small.jsonl", max_bytes=100)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(small))  # type: ignore[arg-type]
    for name in ("one", "two"):
        provider.get_tracer("t").start_span(name).end()
    provider.shutdown()
    assert "one" in (tmp_path / "small.jsonl.1").read_text()
    assert "two" in (tmp_path / "small.jsonl").read_text()


def test_the_otlp_endpoint_may_be_the_collectors_base_url() -> None:
    assert otlp_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_traces_url("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"


async def test_a_batch_with_an_unreadable_header_is_still_parsed() -> None:
    # FastStream's own batch parser fails the whole batch on a non-UTF-8 or null header value.
    parser = AioKafkaBatchParser(msg_class=KafkaMessage, regex=None)
    poisoned = record(b"{}", [("traceparent", b"\xff\xfe"), ("other", None)], offset=1)
    batch = (record(b"{}", [("traceparent", PARENT.encode())]), poisoned)
    with pytest.raises(UnicodeDecodeError):
        await parser.parse_batch(batch)
    message = await _tolerate_headers(batch, parser.parse_batch)
    kept, readable = message.raw_message
    assert kept is batch[0]  # a readable record is handed on as it is
    assert readable.value == poisoned.value and readable.offset == 1
    assert readable.headers == [("traceparent", "\ufffd\ufffd".encode()), ("other", b"")]
    assert header_traceparent(readable.headers) is None
    clean = (batch[0],)
    assert (await _tolerate_headers(clean, parser.parse_batch)).raw_message is clean
