"""Decoding envelopes from raw records, and dead-lettering whatever cannot be decoded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiokafka import ConsumerRecord
from pydantic import ValidationError

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import DeadLetter, LeaderFence
from schemas.registry import upcast
from schemas.validation import describe_validation_error
from services.common.kafka import OutMessage, decode_key, envelope_for

MAX_DEAD_LETTER_VALUE = 64 * 1024


@dataclass(frozen=True)
class Received:
    record: ConsumerRecord[Any, Any]
    envelope: Envelope


def dead_letter(
    record: ConsumerRecord[Any, Any], error: str, *, consumer: str, tenant: str | None = None
) -> OutMessage:
    raw = record.value or b""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    payload = DeadLetter(
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=decode_key(record),
        value=text[:MAX_DEAD_LETTER_VALUE],
        error=error,
        consumer=consumer,
    )
    return OutMessage(
        topics.DEAD_LETTER,
        record.topic,
        envelope_for("DeadLetter", payload, producer=consumer, tenant=tenant),
    )


def decode_envelopes(
    records: tuple[ConsumerRecord[Any, Any], ...],
    *,
    consumer: str,
    fences: list[LeaderFence] | None = None,
) -> tuple[list[Received], list[OutMessage]]:
    """Split a batch into decoded envelopes and dead letters for the rest.

    A scheduler leader's fence (a control record on the topics it decides on) is no event to
    act on: it goes to `fences` for a consumer that honours leader epochs, else it is skipped."""
    good: list[Received] = []
    dead: list[OutMessage] = []
    for record in records:
        try:
            envelope = upcast(Envelope.model_validate_json(record.value or b""))
            if envelope.type == topics.LEADER_FENCE:
                if fences is not None:
                    fences.append(LeaderFence.model_validate(envelope.payload))
                continue
        except ValidationError as exc:
            dead.append(dead_letter(record, describe_validation_error(exc), consumer=consumer))
            continue
        except ValueError as exc:
            dead.append(dead_letter(record, str(exc), consumer=consumer))
            continue
        good.append(Received(record, envelope))
    return good, dead
