"""Decoding envelopes from raw records, and dead-lettering whatever cannot be decoded."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aiokafka import ConsumerRecord
from pydantic import BaseModel, ValidationError

from schemas import topics
from schemas.bounds import WireError, escape_unsafe
from schemas.envelope import Envelope, parse_envelope
from schemas.events import DeadLetter, LeaderFence
from schemas.health import AlertRaised, Severity
from schemas.registry import parse_typed, upcast
from schemas.validation import describe_validation_error
from services.common.kafka import OutMessage, decode_key, envelope_for

MAX_DEAD_LETTER_VALUE = 64 * 1024


@dataclass(frozen=True)
class Received:
    """A record and its envelope. Decoded against its topic's payload model (`models=`), a
    record in the current version is parsed in one pass, and `envelope.payload` is then that
    model, not a dict (`model.model_validate` of it returns it as is); read the payload
    through the model, never as a dict."""

    record: ConsumerRecord[Any, Any]
    envelope: Envelope


def dead_letter(
    record: ConsumerRecord[Any, Any],
    error: str,
    *,
    consumer: str,
    tenant: str | None = None,
    reason: str = "unreadable",
) -> OutMessage:
    """The dead letter for `record`: its exact bytes (base64, first 64 KiB), a readable copy,
    its size and digest, and why. Never raises, whatever the record holds: a dead letter is
    the last resort and must always be writable."""
    raw = record.value
    if raw is None:
        raw = b""
    elif not isinstance(raw, bytes):
        raw = str(raw).encode("utf-8", "backslashreplace")
    return _letter(
        record.topic,
        record.partition,
        record.offset,
        decode_key(record),
        raw,
        error,
        consumer=consumer,
        tenant=tenant,
        reason=reason,
    )


def dead_letter_for_message(
    topic: str, key: str | None, value: bytes, error: str, *, producer: str
) -> OutMessage:
    """The dead letter for an event a service produced and the broker refused (it has no
    partition or offset: both are -1)."""
    return _letter(topic, -1, -1, key, value, error, consumer=producer, reason="unpublishable")


def _letter(
    topic: str,
    partition: int,
    offset: int,
    key: str | None,
    raw: bytes,
    error: str,
    *,
    consumer: str,
    reason: str,
    tenant: str | None = None,
) -> OutMessage:
    head = raw[:MAX_DEAD_LETTER_VALUE]
    payload = DeadLetter(
        source_topic=topic,
        partition=partition,
        offset=offset,
        key=None if key is None else escape_unsafe(key[:1024]),
        value=escape_unsafe(head.decode("utf-8", "replace")),
        value_base64=base64.b64encode(head).decode(),
        size=len(raw),
        sha256=hashlib.sha256(raw).hexdigest(),
        error=escape_unsafe(error[:4096]),
        consumer=consumer,
        reason=reason,
    )
    safe_tenant = tenant if tenant is not None and _SAFE_TENANT.fullmatch(tenant) else None
    return OutMessage(
        topics.DEAD_LETTER,
        topic,
        envelope_for("DeadLetter", payload, producer=consumer, tenant=safe_tenant),
    )


def platform_alert(
    *, alert_id: str, subject: str, cause: str, action: str, producer: str
) -> OutMessage:
    """A critical `alert.raised` about the platform itself (a stalled consumer, an event the
    broker refused): not about a node or a cluster, so `cluster` is empty."""
    alert = AlertRaised(
        alert_id=alert_id,
        severity=Severity.CRITICAL,
        subject=subject,
        cluster="",
        cause=cause,
        suggested_action=action,
        first_seen=datetime.now(UTC),
        count=1,
    )
    return OutMessage(
        topics.ALERT_RAISED, subject, envelope_for("AlertRaised", alert, producer=producer)
    )


_SAFE_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def decode_envelopes(
    records: tuple[ConsumerRecord[Any, Any], ...],
    *,
    consumer: str,
    fences: list[LeaderFence] | None = None,
    models: Mapping[str, type[BaseModel]] | None = None,
) -> tuple[list[Received], list[OutMessage]]:
    """Split a batch into decoded envelopes and dead letters for the rest.

    With `models` (payload model by topic), a record that parses as its topic's model in one
    pass (schemas.registry.parse_typed) carries that model as its payload; any other goes the
    usual way, so what is refused, and why, does not change.

    A scheduler leader's fence (a control record on the topics it decides on) is no event to
    act on: it goes to `fences` for a consumer that honours leader epochs, else it is skipped."""
    good: list[Received] = []
    dead: list[OutMessage] = []
    for record in records:
        if models is not None:
            typed = parse_typed(record.value, models.get(record.topic))
            if typed is not None:
                good.append(Received(record, typed))
                continue
        try:
            envelope = upcast(parse_envelope(record.value or b""))
            if envelope.type == topics.LEADER_FENCE:
                if fences is not None:
                    fences.append(LeaderFence.model_validate(envelope.payload))
                continue
        except ValidationError as exc:
            dead.append(dead_letter(record, describe_validation_error(exc), consumer=consumer))
            continue
        except WireError as exc:
            reason = "too_large" if exc.reason == "too_large" else "unreadable"
            dead.append(dead_letter(record, str(exc), consumer=consumer, reason=reason))
            continue
        except ValueError as exc:
            dead.append(dead_letter(record, str(exc), consumer=consumer))
            continue
        good.append(Received(record, envelope))
    return good, dead


def decode_payloads(
    records: tuple[ConsumerRecord[Any, Any], ...],
    models: Mapping[str, type[BaseModel]],
    *,
    consumer: str,
) -> tuple[list[tuple[Received, Any]], list[OutMessage]]:
    """Envelopes and their payloads validated by topic (`models`); a dead letter for every
    record that is not one (unreadable envelope, or a payload that does not validate)."""
    received, dead = decode_envelopes(records, consumer=consumer, models=models)
    good: list[tuple[Received, Any]] = []
    for got in received:
        try:
            good.append((got, models[got.record.topic].model_validate(got.envelope.payload)))
        except ValidationError as exc:
            dead.append(dead_letter(got.record, describe_validation_error(exc), consumer=consumer))
    return good, dead
