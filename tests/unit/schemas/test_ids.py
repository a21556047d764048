"""Event and job ids: RFC 9562 UUIDv7 strings that sort by the millisecond they were made."""

from __future__ import annotations

import time
import uuid

from schemas.ids import new_id


def test_an_id_is_a_canonical_uuid7_of_now() -> None:
    before = time.time_ns() // 1_000_000
    ids = [new_id() for _ in range(2000)]
    after = time.time_ns() // 1_000_000
    for text in ids:
        u = uuid.UUID(text)
        assert str(u) == text  # canonical: lower case, hyphens where uuid puts them
        assert u.version == 7 and u.variant == uuid.RFC_4122
        assert before <= u.int >> 80 <= after
    assert len(set(ids)) == len(ids)


def test_ids_sort_by_the_millisecond_they_were_made() -> None:
    early = new_id()
    time.sleep(0.002)
    late = new_id()
    assert early < late


def test_the_random_bits_vary_in_every_position() -> None:
    """Every bit that is neither time, version nor variant takes both values over many ids."""
    fixed = (0xF << 76) | (0x3 << 62) | (((1 << 48) - 1) << 80)
    seen_one = 0
    seen_zero = 0
    for _ in range(500):
        value = uuid.UUID(new_id()).int
        seen_one |= value
        seen_zero |= ~value
    random_bits = ((1 << 128) - 1) & ~fixed
    assert seen_one & random_bits == random_bits
    assert seen_zero & random_bits == random_bits
