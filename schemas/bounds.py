"""Bounds on everything that comes over the wire, stated once and used on every path: the
gateway's request bodies, records on Kafka, and the pydantic models themselves (so the JSON
Schemas in docs/schemas/ publish them to other platforms).

A record is refused before it is parsed when it is too large, and when parsed when it is not
strict JSON: not UTF-8, `NaN`/`Infinity` (Python's json takes them; nothing downstream can
compare them), nested deeper than `MAX_JSON_DEPTH`, or holding a NUL or a lone surrogate in
any string or key (PostgreSQL cannot store either). Typed fields then add charsets and
lengths: identifiers are names (`Name`, `Identifier`, `JobId`), free text has no control or
bidi-override characters (`Text`), numbers are finite and in range.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Annotated, Any

from pydantic import AfterValidator, Field

# A record on any topic. Below the broker's default message limit (1 MiB on Kafka) with room
# for the envelope that a service adds when it embeds a spec downstream (job.queued,
# placement.decided).
MAX_RECORD_BYTES = 1 << 20
# A submission (HTTP body or a job.submitted record).
MAX_SUBMISSION_BYTES = 256 << 10
# A job spec as it travels inside other events.
MAX_SPEC_BYTES = 64 << 10
MAX_JSON_DEPTH = 32
MAX_REPLICAS = 2048
MAX_LABELS = 64
MAX_COMMAND_ITEMS = 256


class WireError(ValueError):
    """A record that is not acceptable JSON; `reason` is a RejectReason value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(escape_unsafe(message))  # it may quote what the client sent
        self.reason = reason


def _refuse_constant(name: str) -> Any:
    raise WireError("malformed", f"{name} is not a number JSON allows; send a finite number")


def parse_json(raw: bytes | str, *, max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """Strict, bounded JSON: raises WireError with a worded reason."""
    size = len(raw)
    if size > max_bytes:
        raise WireError(
            "too_large", f"the message is {size:,} bytes; the limit is {max_bytes:,} bytes"
        )
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WireError("malformed", f"the message is not UTF-8: {exc}") from None
    else:
        text = raw
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise WireError(
            "malformed", f"the message is nested too deeply; the limit is {MAX_JSON_DEPTH}"
        ) from None
    except json.JSONDecodeError as exc:
        raise WireError("malformed", f"the message is not valid JSON: {exc}") from None
    if not (isinstance(raw, bytes) and plain(raw)):
        _check_tree(doc)
    return doc


# Bytes that may hide something the strict walk refuses: an escape (\\u0000, a lone surrogate,
# an escaped control or bidi character), NaN or Infinity, DEL, and C1 controls and bidi
# characters written as UTF-8. (Literal C0 controls inside strings are not JSON: every parser
# refuses them. A number too large for a float becomes infinite, which every typed float
# field refuses; in a field nobody reads it does no harm.)
_SUSPECT_UTF8 = re.compile(rb"\xc2[\x80-\x9f]|\xe2\x80[\xaa-\xae]|\xe2\x81[\xa6-\xa9]")


def plain(raw: bytes) -> bool:
    """True when `raw` cannot hold anything the strict walk would refuse (nothing suspect, and
    not nested past the limit): the walk, the costly part of strict parsing, is then skipped,
    and a typed model may parse the bytes itself. Single-byte searches first (any backslash
    counts as suspect: escapes are rare in events), so this costs about 1.5 µs per kilobyte,
    a fraction of parsing."""
    # `find` of one byte is a memchr; `in` and searches for longer needles cost several times
    # more, so a longer token is looked for only where its first byte occurs.
    find = raw.find
    if find(b"\\") >= 0 or find(b"\x7f") >= 0:
        return False
    if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH and _depth(raw) > MAX_JSON_DEPTH:
        return False
    if (find(b"N") >= 0 and find(b"NaN") >= 0) or (find(b"I") >= 0 and find(b"Infinity") >= 0):
        return False
    if find(b"\xc2") >= 0 or find(b"\xe2") >= 0:
        return _SUSPECT_UTF8.search(raw) is None
    return True


_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'{}[]"')
_STEP = [0] * 256
_STEP[ord("{")] = _STEP[ord("[")] = 1
_STEP[ord("}")] = _STEP[ord("]")] = -1


def _depth(raw: bytes) -> int:
    """How deep the brackets outside strings nest (the outermost object or list is 1), for
    bytes with no backslash: every quote then opens or closes a string, so a record with many
    small objects (a demand of 2,000 jobs, an inventory of every node) is measured in a pass
    of C-level byte operations instead of being walked. Bytes that are not JSON may measure
    anything; the parser refuses them anyway."""
    marks = raw.translate(None, _NOT_STRUCTURE)  # quotes and brackets only, in order
    outside = b"".join(marks.split(b'"')[0::2])
    return max(accumulate(map(_STEP.__getitem__, outside)), default=0)


def _check_tree(doc: Any) -> None:
    """Depth, finite numbers, and strings that are safe to store and show, without
    recursion."""
    stack: list[tuple[Any, int, str]] = [(doc, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_JSON_DEPTH:
                raise WireError("malformed", f"nested deeper than {MAX_JSON_DEPTH} at {path}")
            for key, value in node.items():
                _check_text(key, f"{path}.{key!r}" if path else repr(key))
                stack.append((value, depth + 1, f"{path}.{key}" if path else key))
        elif isinstance(node, list):
            if depth > MAX_JSON_DEPTH:
                raise WireError("malformed", f"nested deeper than {MAX_JSON_DEPTH} at {path}")
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node))
        elif isinstance(node, str):
            _check_text(node, path or "(message)")
        elif isinstance(node, float) and not math.isfinite(node):
            raise WireError("malformed", f"{path or '(message)'}: {node} is not a finite number")


def _check_text(value: str, where: str) -> None:
    if "\x00" in value:
        raise WireError("malformed", f"{where}: contains a NUL character")
    try:
        check_safe(value)
    except ValueError as exc:
        raise WireError("malformed", f"{where}: {exc}") from None


# --- typed fields ---------------------------------------------------------------------------

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
# Label keys and other identifiers a platform may namespace (`team.example/owner`).
IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,126}$"
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
# A team, project, user, queue, priority class, cluster: what a person types.
# A price per accelerator-hour, in the platform's currency: far above any accelerator's (a
# datacenter GPU rents for a few units an hour), low enough that the meter's amounts, kept in
# 64-bit millionths, cannot overflow. Negative prices would credit whoever used the node. The
# policy and fleet files are held to the same bound (core.policy.MAX_PRICE).
MAX_PRICE = 100_000.0
Price = Annotated[float, Field(ge=0, le=MAX_PRICE)]

# A node's accelerators (its devices are numbered 0-4095 on the wire, ReplicaAssignment), as
# the fleet file holds them too (core.fleet.MAX_NODE_DEVICES). The scheduler sizes a cycle's
# arrays by the largest node: one node claiming 10**13 stopped every cycle for good.
MAX_NODE_DEVICES = 4096
NodeDevices = Annotated[int, Field(ge=0, le=MAX_NODE_DEVICES)]
# A scheduler leader's lease epoch: one a second for 30,000 years, exact as a double (the
# lease's Lua script counts in doubles) and as a bigint. A forged epoch far above the real ones
# made the leader step down to re-acquire above it, the fences refusing real decisions meanwhile.
MAX_EPOCH = 10**12
Epoch = Annotated[int, Field(ge=0, le=MAX_EPOCH)]
# How long one run ran, in fleet seconds: a decade. The meter cuts a tick per interval of it,
# so a timestamp sent as a duration (1.7e9) made it build tens of millions of ticks at once.
MAX_RUN_S = 10 * 365 * 86400.0
RunSeconds = Annotated[float, Field(ge=0, le=MAX_RUN_S)]
# An amount of the meter's (accelerator-seconds, cost), either sign (a close tick can credit):
# the most its 64-bit millionths can hold. The gateway sums them; past 1e22 its report failed.
MAX_AMOUNT = 9.2e12
Amount = Annotated[float, Field(ge=-MAX_AMOUNT, le=MAX_AMOUNT)]

Name = Annotated[str, Field(min_length=1, max_length=63, pattern=NAME_PATTERN)]
Identifier = Annotated[str, Field(min_length=1, max_length=127, pattern=IDENTIFIER_PATTERN)]
JobId = Annotated[str, Field(min_length=1, max_length=64, pattern=JOB_ID_PATTERN)]
# A client's retry token: printable ASCII without spaces.
IdempotencyKey = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[!-~]+$")]


# What no string on the wire may hold, free text included: C0 controls other than tab, line
# feed and carriage return, DEL and C1 controls, bidi overrides and isolates (they make a log
# line or a terminal show something else than what is there), lone surrogates.
_UNSAFE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# Free text in a job spec (a name, an image, a command word): one line, tab allowed.
_FORBIDDEN_TEXT = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _refuse(value: str, forbidden: re.Pattern[str]) -> str:
    match = forbidden.search(value)
    if match is not None:
        raise ValueError(
            f"must not contain control, bidi or lone surrogate characters (found "
            f"U+{ord(match.group()):04X} "
            f"at position {match.start()})"
        )
    return value


def check_safe(value: str) -> str:
    """`value` if it holds nothing unsafe, else ValueError naming what and where."""
    return _refuse(value, _UNSAFE)


def _plain_text(value: str) -> str:
    return _refuse(value, _FORBIDDEN_TEXT)


def escape_unsafe(text: str) -> str:
    """`text` with every unsafe character shown as a `\\uXXXX` escape: for messages that quote
    what a client sent."""
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def text(max_length: int) -> Any:
    """Free text of at most `max_length` characters, without control or bidi characters."""
    return Annotated[str, Field(max_length=max_length), AfterValidator(_plain_text)]


Text = text(1024)
LongText = text(4096)


def json_size(value: Any) -> int:
    """Bytes of `value` as compact JSON (what it costs inside another event)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
