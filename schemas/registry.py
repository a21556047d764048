"""Payload versions: upcasters that lift an older payload to the current one before validation.

Topic names carry no version. A breaking payload change bumps `Envelope.version` for that
event type and registers a function here that rewrites the old payload; consumers always see
the current shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError, create_model

from schemas.bounds import MAX_RECORD_BYTES, plain
from schemas.envelope import Envelope
from schemas.topics import LEADER_FENCE

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

CURRENT_VERSION: dict[str, int] = {}
_UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def register_upcaster(event_type: str, from_version: int, fn: Upcaster) -> None:
    """Register `fn` lifting `event_type` payloads from `from_version` to `from_version + 1`."""
    _UPCASTERS[(event_type, from_version)] = fn
    CURRENT_VERSION[event_type] = max(CURRENT_VERSION.get(event_type, 1), from_version + 1)


def upcast(envelope: Envelope) -> Envelope:
    version = envelope.version
    payload = envelope.payload
    target = CURRENT_VERSION.get(envelope.type, 1)
    if version > target:
        # Written by a newer producer: guessing at its shape could misread it. Refused with
        # the reason (a dead letter), to replay once this consumer is upgraded.
        raise ValueError(
            f"{envelope.type} version {version} is newer than this consumer reads (up to {target})"
        )
    while version < target:
        fn = _UPCASTERS.get((envelope.type, version))
        if fn is None:
            raise ValueError(f"no upcaster for {envelope.type} v{version}")
        try:
            payload = fn(payload)
        except Exception as exc:
            # An old payload the upcaster cannot lift (a field missing, a wrong type) is bad
            # input like any other: refused with the reason (callers dead-letter ValueErrors),
            # never an error that fails the whole batch and stalls its partition.
            raise ValueError(
                f"{envelope.type} v{version} could not be lifted to v{version + 1}:"
                f" {type(exc).__name__}: {exc}"
            ) from exc
        version += 1
    if version == envelope.version:
        return envelope
    return envelope.model_copy(update={"version": version, "payload": payload})


@functools.cache
def typed_envelope(model: type[BaseModel]) -> type[Envelope]:
    """Envelope whose payload is `model`, so that pydantic parses a record's bytes into both
    in one pass, without building the payload as a dict and validating that again."""
    return create_model(f"{model.__name__}Envelope", __base__=Envelope, payload=(model, ...))


def parse_typed(raw: object, model: type[BaseModel] | None) -> Envelope | None:
    """The record parsed in one pass, its `payload` already a `model` (`model.model_validate`
    of it returns it as is), or None where that does not apply and the caller goes the usual
    way (`parse_envelope`, `upcast`, the payload validated): no model for the topic, bytes the
    strict walk must see (`plain`), an envelope or payload that does not validate (the usual
    way then words the error), an older or newer version, or a leader's fence (it rides on
    topics whose model is another's). So it accepts what the usual way accepts, and gives the
    same payload."""
    if model is None or not isinstance(raw, bytes) or len(raw) > MAX_RECORD_BYTES:
        return None
    if not plain(raw):
        return None
    try:
        envelope = typed_envelope(model).model_validate_json(raw)
    except ValidationError:
        return None
    if envelope.type == LEADER_FENCE or envelope.version != CURRENT_VERSION.get(envelope.type, 1):
        return None
    return envelope
