"""Traces that follow a job from service to service (docs/tracing.md): the OpenTelemetry SDK set
up per process, the W3C `traceparent` read from and written to Kafka records, and `Hops`, the
spans of one batch (one per traced job, never one per batch).

The trace context travels in two places: the record's `traceparent` header (what other tools
read) and the envelope's `traceparent` field (which survives the outbox, dead letters and
replays, and which producers that cannot set headers can fill). A consumer takes the header,
else the field. Anything unusable in either is ignored: tracing never fails a record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from schemas.envelope import Envelope, valid_traceparent
from services.common.kafka import OutMessage
from services.common.settings import ServiceSettings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.trace import Span, Tracer

log = structlog.get_logger()

HEADER = "traceparent"
HEADER_BYTES = HEADER.encode()
# A version-00 traceparent is 55 characters; a longer header value is not read at all.
_MAX_HEADER = 64
_SAMPLED = 0x01
# The dev stack's files: rotated (one older file kept) past this size, per process.
MAX_FILE_BYTES = 64 << 20
# The envelope's own field, found in a serialized envelope without parsing it (the outbox's
# recovery path): only before `"payload":`, so a label inside the payload cannot match.
_IN_VALUE = re.compile(rb'"traceparent":"(00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})"')
_PAYLOAD_KEY = b'"payload":'

Headers = Iterable[Any]


def header_traceparent(headers: Headers | None) -> str | None:
    """The record's `traceparent` header when it is a valid one; None for anything else (no
    header, a value that is not bytes, too long, not ASCII, malformed)."""
    for item in headers or ():
        try:
            name, value = item
        except (TypeError, ValueError):
            continue
        if name != HEADER and name != HEADER_BYTES:
            continue
        if isinstance(value, bytes | bytearray) and len(value) <= _MAX_HEADER:
            text = value.decode("ascii", "replace")
        elif isinstance(value, str) and len(value) <= _MAX_HEADER:
            text = value
        else:
            continue
        if valid_traceparent(text):
            return text
    return None


def incoming(headers: Headers | None, envelope: Envelope | None = None) -> str | None:
    """The trace context a record continues: its header, else its envelope's field."""
    found = header_traceparent(headers)
    if found is None and envelope is not None:
        return envelope.traceparent
    return found


def traceparent_in(value: bytes) -> str | None:
    """The `traceparent` field of a serialized envelope, without parsing it."""
    end = value.find(_PAYLOAD_KEY)
    found = _IN_VALUE.search(value, 0, end if end >= 0 else len(value))
    if found is None:
        return None
    text = found.group(1).decode()
    return text if valid_traceparent(text) else None


def sampled(traceparent: str) -> bool:
    return bool(int(traceparent[53:55], 16) & _SAMPLED)


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def _parent_context(traceparent: str) -> Any:
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    parent = SpanContext(
        trace_id=int(traceparent[3:35], 16),
        span_id=int(traceparent[36:52], 16),
        is_remote=True,
        trace_flags=TraceFlags(int(traceparent[53:55], 16)),
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))


def _traceparent_of(span: Span) -> str:
    ctx = span.get_span_context()
    return format_traceparent(ctx.trace_id, ctx.span_id, int(ctx.trace_flags))


class Tracing:
    """One process's tracer and where its spans go."""

    def __init__(self, provider: TracerProvider, service: str) -> None:
        self.provider = provider
        self.service = service
        self.tracer: Tracer = provider.get_tracer("quartermaster")

    @classmethod
    def configure(cls, name: str, settings: ServiceSettings) -> Tracing | None:
        """From the settings: OTLP when `otlp_endpoint` is set, JSON lines under `trace_dir`
        when that is, else None (off: the services then build no span at all). `name` is the
        process's name, `service` or `service/instance` (an executor's cluster)."""
        if not settings.otlp_endpoint and not settings.trace_dir:
            return None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        service, _, instance = name.partition("/")
        attributes = {"service.name": service, "service.namespace": "quartermaster"}
        if instance:
            attributes["service.instance.id"] = instance
        provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio)),
            resource=Resource.create(attributes),
            shutdown_on_exit=False,
        )
        exporter: Any
        if settings.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_traces_url(settings.otlp_endpoint))
        else:
            file = f"{name.replace('/', '-')}.{os.getpid()}.jsonl"
            exporter = JsonLinesExporter(Path(settings.trace_dir) / file)
        # Spans are handed to a queue here and written by the processor's own thread, so the
        # event loop never waits for a file or a collector. Exported every half second: a
        # trace is readable moments after the job moved.
        provider.add_span_processor(
            BatchSpanProcessor(exporter, max_queue_size=16384, schedule_delay_millis=500)
        )
        return cls(provider, service)

    def hops(self, name: str, *, root: bool = False) -> Hops:
        return Hops(self.tracer, name, root=root)

    @contextlib.contextmanager
    def started(self, name: str, **attributes: Any) -> Iterator[str]:
        """A trace's first span (the gateway's submit) around the block; yields the
        traceparent to put on what the block publishes. An exception marks it failed."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        span = self.tracer.start_span(name, kind=SpanKind.PRODUCER, attributes=_qm(attributes))
        try:
            yield _traceparent_of(span)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))
            raise
        finally:
            span.end()

    def shutdown(self) -> None:
        """Export what is queued, then stop (blocks: call it off the event loop)."""
        self.provider.shutdown()


def hops(tracing: Tracing | None, name: str, *, root: bool = False) -> Hops:
    """A batch's hops: does nothing, at no cost, when tracing is off."""
    return Hops(tracing.tracer if tracing is not None else None, name, root=root)


def otlp_traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL from a collector's base URL (http://collector:4318)."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def _qm(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes under the `qm.` namespace; None values left out."""
    return {f"qm.{k}": v for k, v in attributes.items() if v is not None}


def by_cause(message: OutMessage) -> str | None:
    return message.envelope.causation_id


def by_key(message: OutMessage) -> str | None:
    return message.key


class Hops:
    """The spans of one batch at one hop (`queue.admit`, `executor.start`...): one per traced
    incoming event, keyed by what ties the batch's outgoing messages to it (the event id, which
    is their causation id; or the job id).

    Cheap by construction: nothing happens with tracing off; an event without a trace context
    gets a span only where a trace may start (`root`); an unsampled context is passed on as it
    is, without a span."""

    def __init__(self, tracer: Tracer | None, name: str, *, root: bool = False) -> None:
        self._tracer = tracer
        self._name = name
        self._root = root
        self._spans: dict[str, Span] = {}
        self._emitted: dict[str, list[str]] = {}
        self._out: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self._out)

    def __enter__(self) -> Hops:
        return self

    def __exit__(self, _type: Any, error: BaseException | None, _tb: Any) -> None:
        self.close(error)

    def open(
        self,
        key: str,
        traceparent: str | None,
        *,
        start_ns: int | None = None,
        **attributes: Any,
    ) -> None:
        """A span for the event `key` carried, a child of `traceparent` (or a new trace)."""
        tracer = self._tracer
        if tracer is None or key in self._out:
            return
        if traceparent is None:
            if not self._root:
                return
            context = None
        elif not sampled(traceparent):
            self._out[key] = traceparent
            return
        else:
            context = _parent_context(traceparent)
        from opentelemetry.trace import SpanKind

        span = tracer.start_span(
            self._name,
            context=context,
            kind=SpanKind.CONSUMER,
            attributes=_qm(attributes),
            start_time=start_ns,
        )
        self._out[key] = _traceparent_of(span)
        if span.is_recording():
            self._spans[key] = span

    def event(self, name: str, at_ns: int) -> None:
        """A moment every open span shares (the scheduler's cycle starting)."""
        for span in self._spans.values():
            span.add_event(name, timestamp=at_ns)

    def stamp(
        self,
        messages: Iterable[OutMessage],
        key: Callable[[OutMessage], str | None] = by_cause,
    ) -> None:
        """Put the trace context on every message caused by a traced event; call it before
        the messages are encoded (the outbox, the producer)."""
        if not self._out:
            return
        for message in messages:
            k = key(message)
            traceparent = self._out.get(k) if k is not None else None
            if traceparent is not None:
                message.envelope.traceparent = traceparent
                if k in self._spans:
                    self._emitted.setdefault(k, []).append(message.envelope.type)

    def close(
        self,
        error: BaseException | None = None,
        failed: Sequence[str] = (),
        end_ns: int | None = None,
    ) -> None:
        """End every span; all of them failed with `error`, or those keyed in `failed`."""
        if not self._spans:
            return
        from opentelemetry.trace import Status, StatusCode

        bad = set(failed)
        for k, span in self._spans.items():
            if k in self._emitted:
                span.set_attribute("qm.emitted", tuple(self._emitted[k]))
            if error is not None or k in bad:
                why = f"{type(error).__name__}: {error}" if error is not None else "not published"
                span.set_status(Status(StatusCode.ERROR, why[:200]))
            span.end(end_time=end_ns)
        self._spans.clear()


class JsonLinesExporter:
    """Spans as JSON lines in one file per process (the dev stack's traces, read by `qm
    trace`): no collector needed. Past `max_bytes` the file is moved to `<name>.1` (replacing
    the one before) and a new one begun."""

    def __init__(self, path: Path, max_bytes: int = MAX_FILE_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._fd: int | None = None
        path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        data = b"".join(
            json.dumps(span_record(s), separators=(",", ":"), default=str).encode() + b"\n"
            for s in spans
        )
        try:
            with self._lock:
                self._write(data)
        except OSError:
            log.warning("spans not written", path=str(self.path), exc_info=True)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def _write(self, data: bytes) -> None:
        if self._fd is not None and os.fstat(self._fd).st_size > self.max_bytes:
            os.close(self._fd)
            self._fd = None
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as the dev stack's files hold it (docs/tracing.md)."""
    ctx = span.context
    parent = span.parent
    resource = span.resource.attributes
    record: dict[str, Any] = {
        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
        "span_id": f"{ctx.span_id:016x}" if ctx else None,
        "parent_id": f"{parent.span_id:016x}" if parent else None,
        "name": span.name,
        "service": resource.get("service.name"),
        "instance": resource.get("service.instance.id"),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name.lower(),
        "attributes": dict(span.attributes or {}),
    }
    if span.status.description:
        record["error"] = span.status.description
    if span.events:
        record["events"] = [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ]
    if span.links:
        record["links"] = [
            {"trace_id": f"{ln.context.trace_id:032x}", "span_id": f"{ln.context.span_id:016x}"}
            for ln in span.links
        ]
    return record
