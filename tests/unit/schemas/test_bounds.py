"""Bounded wire types: what a careless or hostile producer sends is refused with a reason on
every path (bare spec on Kafka, envelope, Python-built model), and cheaply."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from schemas.bounds import (
    MAX_JSON_DEPTH,
    MAX_RECORD_BYTES,
    MAX_SPEC_BYTES,
    Name,
    WireError,
    _depth,
    parse_json,
)
from schemas.envelope import parse_envelope
from schemas.events import RejectReason
from schemas.job import JobSpec
from schemas.validation import Submission, Unparseable, parse_submission

GOOD = {"tenant": "vision", "resources": {"accelerators": 1}}


def submit(doc: object) -> Submission | Unparseable:
    return parse_submission(json.dumps(doc, allow_nan=True).encode())


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused_on_every_path(token: str) -> None:
    bare = f'{{"tenant": "vision", "resources": {{"cpu": {token}}}}}'.encode()
    got = parse_submission(bare)
    assert isinstance(got, Unparseable) and got.reason is RejectReason.MALFORMED
    assert token.lstrip("-") in got.message
    envelope = f'{{"type": "JobSubmitted", "payload": {{"tenant": "v", "x": {token}}}}}'
    with pytest.raises(WireError):
        parse_envelope(envelope.encode())
    with pytest.raises(ValidationError, match="finite"):
        JobSpec(tenant="vision", resources={"cpu": float(token.lower().replace("inity", ""))})


def test_a_nan_in_an_unknown_field_is_refused_too() -> None:
    got = parse_submission(b'{"tenant": "vision", "extra": {"deep": [1, NaN]}}')
    assert isinstance(got, Unparseable) and got.reason is RejectReason.MALFORMED


@pytest.mark.parametrize(
    "tenant",
    ["a\x00b", "team\u202eevil", "x'; DROP TABLE jobs;--", "a\nb", "", "t" * 64, "é"],
)
def test_a_tenant_outside_the_charset_is_refused_with_a_reason(tenant: str) -> None:
    got = submit({**GOOD, "tenant": tenant})
    assert isinstance(got, Unparseable)
    assert got.reason in (RejectReason.INVALID_SPEC, RejectReason.MALFORMED)
    assert "tenant" in got.message or "NUL" in got.message
    assert got.tenant is None  # never recovered: a rejection must not carry it on


def test_nul_anywhere_in_a_record_is_refused_before_validation() -> None:
    got = submit({**GOOD, "labels": {"note": "a\x00b"}})
    assert isinstance(got, Unparseable) and "NUL" in got.message
    with pytest.raises(WireError, match="NUL"):
        parse_json(json.dumps({"k\x00": 1}))


def test_a_lone_surrogate_is_refused() -> None:
    with pytest.raises(WireError, match="surrogate"):
        parse_json(b'{"name": "\\ud800"}')


def test_free_text_refuses_control_and_bidi_characters() -> None:
    for bad in ({"name": "a\u202eb"}, {"command": ["ok", "x\x1b[2J"]}, {"image": "i\nj"}):
        got = submit({**GOOD, **bad})
        # Bidi and escape characters are refused for the whole record when it is parsed
        # (malformed); a line break in one-line text by the field (invalid_spec).
        assert isinstance(got, Unparseable), bad
        assert got.reason in (RejectReason.MALFORMED, RejectReason.INVALID_SPEC), bad
    ok = submit({**GOOD, "name": "tab\tis fine", "command": ["python", "-c", "print('hi')"]})
    assert isinstance(ok, Submission)


def test_an_oversized_record_is_refused_as_too_large_without_parsing() -> None:
    big = json.dumps({**GOOD, "name": "x" * (2 << 20)}).encode()
    got = parse_submission(big)
    assert isinstance(got, Unparseable) and got.reason is RejectReason.TOO_LARGE
    assert "limit" in got.message
    with pytest.raises(WireError) as exc:
        parse_envelope(b" " * (MAX_RECORD_BYTES + 1))
    assert exc.value.reason == "too_large"


def test_deep_nesting_is_refused_quickly() -> None:
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        raw = ("[" * depth + "]" * depth).encode()
        started = time.perf_counter()
        with pytest.raises(WireError, match="nested"):
            parse_json(raw)
        # Generous: the point is no RecursionError escaping, and no quadratic walk.
        assert time.perf_counter() - started < 5
    assert parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None


def test_a_spec_too_large_for_the_events_that_carry_it_is_refused() -> None:
    command = ["x" * 4000] * (MAX_SPEC_BYTES // 4000 + 2)
    got = submit({**GOOD, "command": command})
    assert isinstance(got, Unparseable) and "limit" in got.message
    # labels alone, each within its own bounds, can pass the limit as well
    labels = {f"label-{i:03d}-{'k' * 100}": "v" * 1024 for i in range(64)}
    got = submit({**GOOD, "labels": labels})
    assert isinstance(got, Unparseable) and "limit" in got.message


def test_numbers_are_in_range() -> None:
    for bad in (
        {"replicas": 100_000},
        {"resources": {"accelerators": 10**9}},
        {"resources": {"cpu": 1e300}},
        {"max_runtime_s": 1e12},
    ):
        got = submit({**GOOD, **bad})
        assert isinstance(got, Unparseable), bad


def test_the_examples_are_still_accepted() -> None:
    from pathlib import Path

    import yaml

    jobs = sorted((Path(__file__).resolve().parents[3] / "examples" / "jobs").iterdir())
    assert jobs
    for path in jobs:
        doc = yaml.safe_load(path.read_text())
        assert isinstance(submit({"tenant": "vision", **doc}), Submission), path


@given(st.text(max_size=80))
def test_any_accepted_name_is_storable_and_printable(value: str) -> None:
    try:
        TypeAdapter(Name).validate_python(value)
    except ValidationError:
        return
    assert value.isascii() and value.isprintable() and "\x00" not in value


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "\\u0000"}',
        b'{"a": "\\ud800"}',
        '{"a": "x\u202ey"}'.encode(),
        '{"a": "x\u2066y"}'.encode(),
        '{"a": "x\u0085y"}'.encode(),
        b'{"a": "x\x7fy"}',
        b'{"a": NaN}',
        b'{"a": [Infinity]}',
        b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
    ],
)
def test_what_the_strict_walk_refuses_never_takes_the_fast_path(raw: bytes) -> None:
    from schemas.bounds import plain

    assert not plain(raw)
    with pytest.raises(WireError):
        parse_json(raw)


def test_an_ordinary_event_takes_the_fast_path_and_reads_the_same() -> None:
    from schemas.bounds import plain
    from schemas.envelope import Envelope

    raw = (
        Envelope(type="JobStarted", tenant="vision", payload={"job_id": "j-1", "nodes": ["n1"]})
        .model_dump_json()
        .encode()
    )
    assert plain(raw)
    assert parse_envelope(raw) == Envelope.model_validate(json.loads(raw))


def _nesting(doc: object) -> int:
    if isinstance(doc, dict):
        return 1 + max(map(_nesting, doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max(map(_nesting, doc), default=0)
    return 0


# Text that UTF-8 can encode: a lone surrogate cannot be on the wire, and json.dumps would
# write it into bytes that .encode() refuses (hypothesis draws one now and then).
_UTF8 = st.characters(codec="utf-8")
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=_UTF8, max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(alphabet=_UTF8, max_size=4), inner, max_size=4)
    ),
    max_leaves=60,
)


@given(_JSON)
def test_the_depth_outside_strings_is_the_documents_nesting(doc: object) -> None:
    from schemas.bounds import _depth

    raw = json.dumps(doc, ensure_ascii=False).encode()
    if b"\\" in raw:
        return  # escaped quotes: the fast path never measures such bytes
    assert _depth(raw) == _nesting(doc)


def test_many_shallow_objects_take_the_fast_path_and_one_deep_one_does_not() -> None:
    from schemas.bounds import plain

    shallow = {"jobs": [{"job_id": f"j-{i}", "types": ["h100"]} for i in range(2000)]}
    assert plain(json.dumps(shallow).encode())
    # brackets inside strings are text, however many
    assert plain(json.dumps({"a": "[{" * 100}).encode())
    nested: object = 1
    for _ in range(MAX_JSON_DEPTH):  # one level past the limit, below the 2,000 shallow ones
        nested = [nested]
    deep = {"jobs": shallow["jobs"], "last": nested}
    raw = json.dumps(deep).encode()
    assert not plain(raw)
    with pytest.raises(WireError):
        parse_json(raw)
    assert _nesting(deep) == MAX_JSON_DEPTH + 1


def _plain_as_stated(raw: bytes) -> bool:
    """`plain` as its docstring states it, one plain search per token."""
    if b"\\" in raw or b"\x7f" in raw or b"NaN" in raw or b"Infinity" in raw:
        return False
    if _SUSPECT.search(raw):
        return False
    return _depth(raw) <= MAX_JSON_DEPTH


_SUSPECT = re.compile(rb"\xc2[\x80-\x9f]|\xe2\x80[\xaa-\xae]|\xe2\x81[\xa6-\xa9]")
# Fragments around each token `plain` looks for, and the bytes its searches start from.
_PIECES = st.sampled_from(
    [
        *(b"N", b"Na", b"NaN", b"aN", b"I", b"Inf", b"Infinity", b"nity", b"\\", b"\x7f"),
        *(b'"', b":", b"{", b"}", b"[", b"]", b"[" * 40, b"]" * 40, b"{" * 20),
        *(b"\xc2", b"\xc2\x85", b"\xc2\xa0", b"\xe2", b"\xe2\x80", b"\xe2\x80\xae"),
        *(b"\xe2\x80\x94", b"\xe2\x81\xa6", b"\xe2\x81\xaa", b"a", b"0", b" ", b"job"),
        b"NodeUnhealthy",
    ]
)


@given(st.lists(_PIECES, max_size=60).map(b"".join))
def test_plain_is_exactly_its_stated_checks(raw: bytes) -> None:
    from schemas.bounds import plain

    assert plain(raw) == _plain_as_stated(raw)
