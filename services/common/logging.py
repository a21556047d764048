"""structlog set up once per process: JSON off a terminal, console on one; contextvars bound."""

from __future__ import annotations

import logging
import sys
from contextlib import AbstractContextManager

import structlog

from schemas.envelope import Envelope


def configure_logging(service: str, fmt: str = "auto", level: str = "INFO") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    # Libraries (aiokafka, uvicorn) log through stdlib logging: keep them quiet but visible.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(name)s %(message)s")


def bind_event(envelope: Envelope, job_id: str | None = None) -> AbstractContextManager[None]:
    """Bind the job, tenant and trace of the event being handled to every log line inside."""
    return structlog.contextvars.bound_contextvars(
        job_id=job_id or _job_id(envelope.payload),
        tenant=envelope.tenant,
        trace_id=envelope.trace_id,
        event_id=envelope.event_id,
    )


def _job_id(payload: object) -> object:
    # A payload is a dict, or already its model (services.common.deadletter.Received).
    return payload.get("job_id") if isinstance(payload, dict) else getattr(payload, "job_id", None)
