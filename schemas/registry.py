"""Payload versions: upcasters that lift an older payload to the current one before validation.

Topic names carry no version. A breaking payload change bumps `Envelope.version` for that
event type and registers a function here that rewrites the old payload; consumers always see
the current shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.envelope import Envelope

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
        payload = fn(payload)
        version += 1
    if version == envelope.version:
        return envelope
    return envelope.model_copy(update={"version": version, "payload": payload})
