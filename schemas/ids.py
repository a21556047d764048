"""Sortable unique ids for events and jobs (time-ordered, 128-bit, UUIDv7 layout)."""

from __future__ import annotations

import os
import time
import uuid


def new_id() -> str:
    """A UUIDv7 string: 48 bits of Unix milliseconds, then randomness, so ids sort by time."""
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << 80 | rand
    # Set the version (7) and the RFC 4122 variant bits.
    value &= ~(0xF << 76)
    value |= 0x7 << 76
    value &= ~(0x3 << 62)
    value |= 0x2 << 62
    return str(uuid.UUID(int=value))
