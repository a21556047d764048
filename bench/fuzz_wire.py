"""The fuzz's vocabulary (hostile classes, expectations, a record in the making) and the byte
tricks its builders share: JSON with NaN, holes filled with deep nesting or megabytes."""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any


class HostileClass(StrEnum):
    UNPARSEABLE = "unparseable"  # not JSON at all, empty, a null value, truncated
    WRONG_TYPES = "wrong_types"  # JSON, but not an envelope, or a field of the wrong type
    NAN_INFINITY = "nan_infinity"  # NaN / Infinity literals (not JSON, but Python writes them)
    CONTROL_CHARS = "control_chars"  # NUL, bidi overrides, terminal escapes in strings
    OVERSIZED = "oversized"  # a record over the 1 MiB bound (2 MiB by default)
    DEEP_NESTING = "deep_nesting"  # over the depth bound (64) and parser-breaking (100,000)
    UNKNOWN_TYPE = "unknown_type"  # an envelope type or version nobody knows
    UNKNOWN_ENTITY = "unknown_entity"  # valid, about a job / run / node nobody knows
    DUPLICATE = "duplicate"  # the same record twice
    OUT_OF_ORDER = "out_of_order"  # the later event first; times far off; a cancel first


class Expect(StrEnum):
    """What must become of a record (bench/fuzz.py's docstring has the table)."""

    REFUSED = "refused"  # dead-lettered, or (job.submitted) a job.rejected with a reason code
    ANSWERED = "answered"  # its job reaches a terminal state (`outcome` if set), queued once
    NOT_RUN = "not_run"  # ignored, dead-lettered or rejected, but never queued
    TOLERATED = "tolerated"  # anything, as long as nothing stalls or dies


@dataclass(frozen=True)
class Draft:
    """A hostile record before it is given its topic, partition, class and round."""

    variant: str
    key: bytes | None
    value: bytes | None
    expect: Expect
    job_id: str | None = None
    event_id: str | None = None
    reasons: tuple[str, ...] = ()
    outcome: str | None = None

    def fields(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Context:
    """What a class builder needs: the round's RNG, a unique tag, the variant rotation."""

    rng: random.Random
    tag: str
    turn: int
    at: datetime
    oversize_bytes: int

    def pick(self, variants: list[Any]) -> Any:
        return variants[self.turn % len(variants)]

    def event_id(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))


# A string value to be replaced after serialising: by deep nesting or by padding.
HOLE = "@@FUZZ-HOLE@@"
_QUOTED_HOLE = json.dumps(HOLE)


def dump(doc: Any) -> str:
    """Compact JSON, NaN and Infinity written as Python writes them (not valid JSON)."""
    return json.dumps(doc, allow_nan=True, separators=(",", ":"))


def envelope(
    event_type: str, payload: Any, event_id: str, at: datetime, **over: Any
) -> dict[str, Any]:
    env = {
        "event_id": event_id,
        "type": event_type,
        "version": 1,
        "occurred_at": at.isoformat(),
        "producer": "fuzz",
        "trace_id": event_id,
        "payload": payload,
    }
    return {**env, **over}


def deep(text: str, depth: int, kind: str) -> bytes:
    """`text` with its hole replaced by `depth` nested arrays (`[`) or objects (`{`)."""
    tree = "[" * depth + "]" * depth if kind == "[" else '{"a":' * depth + "{}" + "}" * depth
    return text.replace(_QUOTED_HOLE, tree, 1).encode()


def padded(text: str, size: int, rng: random.Random) -> bytes:
    """`text` with its hole replaced by a string that makes the record `size` bytes long."""
    block = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(64))
    need = max(0, size - len(text) + len(_QUOTED_HOLE) - 2)
    pad = (block * (need // len(block) + 1))[:need]
    return text.replace(_QUOTED_HOLE, json.dumps(pad), 1).encode()


def truncated(text: str, rng: random.Random) -> bytes:
    return text.encode()[: rng.randint(1, max(1, len(text) - 1))]


def garbage_key(rng: random.Random) -> bytes:
    return b"\xff\x00" + bytes(rng.getrandbits(8) for _ in range(8))
