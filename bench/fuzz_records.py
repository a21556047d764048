"""The fuzz's hostile records, generated deterministically from a seed: for every consumed
topic, every class (HostileClass) and every partition, one or two records, each with what
the platform must do about it (Expect). bench/fuzz.py writes them and audits the answers.

Variants within a class rotate with the topic, the partition and the round, so a topic with
four partitions sees four different ways of being wrong and neighbouring topics see others;
the seed picks the ids, the rotation's start, the field that gets the bad value and the order
records are written in. Ghost events carry the time given (the run's start), nothing else
varies from run to run.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from bench.fuzz_ghosts import Ghost, ghost_payload, key_of
from bench.fuzz_submissions import SUBMISSION_CLASSES
from bench.fuzz_wire import (
    HOLE,
    Context,
    Draft,
    Expect,
    HostileClass,
    deep,
    dump,
    envelope,
    garbage_key,
    padded,
    truncated,
)
from schemas import topics

TENANTS = ("vision", "nlp", "speech")
OUTSIDER = "fuzz-outsider"
STRANGER = "fuzz-nowhere"
ID_FIELDS = ("job_id", "node_id", "cluster", "tenant", "tick_id", "budget_id", "run_id")
TEXT_FIELDS = ("message", "detail", "reason", "cause", "requested_by", "leader", "location")
FAR_FUTURE = "9999-12-31T23:59:59+00:00"
LONG_AGO = "0001-01-01T00:00:00+00:00"


@dataclass(frozen=True)
class HostileRecord:
    topic: str
    partition: int
    cls: HostileClass
    round: int
    variant: str
    key: bytes | None
    value: bytes | None
    expect: Expect
    job_id: str | None = None  # the job whose fate answers for the record (job.submitted)
    event_id: str | None = None  # our envelope's id: a rejection names it as its cause
    reasons: tuple[str, ...] = ()  # REFUSED: acceptable reason codes of a job.rejected
    outcome: str | None = None  # ANSWERED: the outcome the job must end with

    def label(self) -> str:
        return (
            f"{self.topic}[{self.partition}] {self.cls.value}/{self.variant} (round {self.round})"
        )


@dataclass(frozen=True)
class LateJob:
    """A valid job written with the valid traffic whose fate a hostile record decided (a
    cancel that arrived before it): it must end with `outcome`."""

    job_id: str
    partition: int
    value: bytes
    outcome: str


@dataclass
class Round:
    records: list[HostileRecord] = field(default_factory=list)
    late_jobs: list[LateJob] = field(default_factory=list)


def generate_round(
    seed: int,
    round_no: int,
    partitions: Mapping[str, int],
    clusters: Mapping[str, str],
    at: datetime,
    oversize_bytes: int = 2 << 20,
) -> Round:
    """Every hostile record of one round. `partitions`: topic -> partition count (every topic
    to fuzz); `clusters`: real cluster -> one accelerator type it has; `at`: the time ghost
    events claim. Same arguments, same records, byte for byte."""
    rng = random.Random(f"fuzz/{seed}/{round_no}")
    start = rng.randrange(1000)  # where each class's variant rotation begins
    groups: list[list[HostileRecord]] = []
    late: list[LateJob] = []
    for t_index, topic in enumerate(sorted(partitions)):
        for partition in range(partitions[topic]):
            for c_index, cls in enumerate(HostileClass):
                tag = f"fz{seed}-{round_no}-{t_index:02d}{partition}{c_index}"
                ctx = Context(rng, tag, start + t_index + partition + round_no, at, oversize_bytes)
                cluster = rng.choice(sorted(clusters))
                ghost = Ghost(
                    job=f"{tag}-job",
                    node=f"{tag}-node",
                    cluster=cluster,
                    accelerator_type=clusters[cluster],
                    stranger=f"{STRANGER}-{tag}",
                    tenant=rng.choice(TENANTS),
                    outsider=OUTSIDER,
                    attempt=rng.randint(1, 3),
                    at=at,
                )
                if topic == topics.JOB_SUBMITTED:
                    drafts = SUBMISSION_CLASSES[cls](ctx, ghost)
                elif topic == topics.JOB_CANCEL_REQUESTED and cls is HostileClass.OUT_OF_ORDER:
                    drafts, job = _cancel_before_job(ctx, ghost, partition)
                    late.append(job)
                else:
                    drafts = GENERIC_CLASSES[cls](ctx, topic, ghost)
                groups.append(
                    [HostileRecord(topic, partition, cls, round_no, **d.fields()) for d in drafts]
                )
    rng.shuffle(groups)  # pairs (duplicates, out of order) stay together and in order
    return Round([r for g in groups for r in g], late)


def _event_type(topic: str) -> str:
    return topics.BY_NAME[topic].event_type if topic in topics.BY_NAME else "Unknown"


def _env(ctx: Context, topic: str, payload: Any, **over: Any) -> dict[str, Any]:
    return envelope(_event_type(topic), payload, ctx.event_id(), ctx.at, **over)


def _field(ctx: Context, payload: dict[str, Any], *prefer: Iterable[str]) -> str:
    """A string field of `payload` to spoil: from the first of `prefer` it has any of."""
    for names in prefer:
        present = [n for n in names if isinstance(payload.get(n), str)]
        if present:
            return str(ctx.rng.choice(present))
    return str(ctx.rng.choice(sorted(payload)))


def _numbers(payload: dict[str, Any]) -> list[str]:
    return sorted(
        k for k, v in payload.items() if isinstance(v, int | float) and not isinstance(v, bool)
    )


def _wrong(value: Any) -> Any:
    """A value of another JSON type than `value`, that no validator coerces back."""
    if isinstance(value, bool):
        return "maybe"
    if isinstance(value, int | float):
        return "many"
    if isinstance(value, str):
        return {"not": "a string"}
    if isinstance(value, list):
        return {"not": "a list"}
    return ["not", "an object"]


Builder = Callable[[Context, str, Ghost], list[Draft]]


def _unparseable(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    whole = dump(_env(ctx, topic, ghost_payload(topic, g)))
    variants: list[tuple[str, bytes | None]] = [
        ("empty", b""),
        ("null-value", None),
        ("binary", bytes(ctx.rng.getrandbits(8) for _ in range(64)) + b"\xff\xfe"),
        ("truncated", truncated(whole, ctx.rng)),
        ("python-repr", repr({"type": _event_type(topic), "payload": {"job_id": g.job}}).encode()),
        ("trailing-garbage", whole.encode() + b" }{ trailing"),
    ]
    name, value = ctx.pick(variants)
    return [Draft(name, garbage_key(ctx.rng) if ctx.turn % 2 else None, value, Expect.REFUSED)]


def _wrong_types(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    payload = ghost_payload(topic, g)
    env = _env(ctx, topic, payload)
    spoiled = str(ctx.rng.choice(sorted(payload)))
    variants: list[tuple[str, Any]] = [
        ("json-array", [env]),
        ("json-string", _event_type(topic)),
        ("json-null", None),
        ("payload-list", {**env, "payload": [payload]}),
        ("occurred-at-garbage", {**env, "occurred_at": "the day after tomorrow"}),
        ("version-string", {**env, "version": "two"}),
        (f"payload-{spoiled}", {**env, "payload": {**payload, spoiled: _wrong(payload[spoiled])}}),
    ]
    name, doc = ctx.pick(variants)
    return [Draft(name, key_of(topic, g).encode(), dump(doc).encode(), Expect.REFUSED)]


def _nan_infinity(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    payload = ghost_payload(topic, g)
    env = _env(ctx, topic, payload)
    numbers = _numbers(payload)
    target = ctx.rng.choice(numbers) if numbers else "fuzz_score"
    variants: list[tuple[str, Any]] = [
        (f"nan-{target}", {**env, "payload": {**payload, target: float("nan")}}),
        (f"infinity-{target}", {**env, "payload": {**payload, target: float("inf")}}),
        (f"minus-infinity-{target}", {**env, "payload": {**payload, target: float("-inf")}}),
        ("nan-version", {**env, "version": float("nan")}),
        ("nan-extra-field", {**env, "payload": {**payload, "fuzz_score": float("nan")}}),
    ]
    name, doc = ctx.pick(variants)
    return [Draft(name, key_of(topic, g).encode(), dump(doc).encode(), Expect.REFUSED)]


CONTROL = {"nul": "\x00", "bidi": "\u202e", "escape": "\x1b[31m", "isolate": "\u2066"}


def _control_chars(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    payload = ghost_payload(topic, g)
    env = _env(ctx, topic, payload)
    ident = _field(ctx, payload, ID_FIELDS)
    text = _field(ctx, payload, TEXT_FIELDS, ID_FIELDS)
    variants: list[tuple[str, bytes]] = []
    for name, char in CONTROL.items():
        spoiled = {**payload, ident: f"{payload[ident]}{char}x"}
        variants.append((f"{name}-in-{ident}", dump({**env, "payload": spoiled}).encode()))
    nul_text = {**payload, text: f"{payload[text]}\x00"}
    variants.append((f"nul-in-{text}", dump({**env, "payload": nul_text}).encode()))
    raw = dump({**env, "payload": {**payload, ident: "RAWNUL"}}).replace("RAWNUL", "a\x00b")
    variants.append(("raw-nul-byte", raw.encode()))
    name, value = ctx.pick(variants)
    return [Draft(name, key_of(topic, g).encode(), value, Expect.REFUSED)]


def _oversized(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    payload = ghost_payload(topic, g)
    env = _env(ctx, topic, payload)
    text = _field(ctx, payload, TEXT_FIELDS, ID_FIELDS)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("extra-payload-field", {**env, "payload": {**payload, "fuzz_padding": HOLE}}),
        (f"long-{text}", {**env, "payload": {**payload, text: HOLE}}),
        ("extra-envelope-field", {**env, "fuzz_padding": HOLE}),
    ]
    name, doc = ctx.pick(variants)
    value = padded(dump(doc), ctx.oversize_bytes, ctx.rng)
    return [Draft(name, key_of(topic, g).encode(), value, Expect.REFUSED)]


def _deep_nesting(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    payload = ghost_payload(topic, g)
    env = _env(ctx, topic, {**payload, "fuzz_tree": HOLE})
    variants = [("arrays-64", 64, "["), ("objects-64", 64, "{"), ("arrays-100k", 100_000, "[")]
    variants.append(("objects-100k", 100_000, "{"))
    name, depth, kind = ctx.pick(variants)
    value = deep(dump(env), depth, kind)
    return [Draft(name, key_of(topic, g).encode(), value, Expect.REFUSED)]


def _unknown_type(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    payload = ghost_payload(topic, g)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("unknown-type-valid-payload", {**_env(ctx, topic, payload), "type": "FuzzUnknownEvent"}),
        ("unknown-type-odd-payload", {**_env(ctx, topic, {"fuzz": True}), "type": "FuzzCmd"}),
        ("future-version", _env(ctx, topic, payload, version=99)),
    ]
    name, doc = ctx.pick(variants)
    return [Draft(name, key_of(topic, g).encode(), dump(doc).encode(), Expect.TOLERATED)]


def _unknown_entity(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    value = dump(_env(ctx, topic, ghost_payload(topic, g))).encode()
    return [Draft("ghost", key_of(topic, g).encode(), value, Expect.TOLERATED)]


def _duplicate(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    value = dump(_env(ctx, topic, ghost_payload(topic, g))).encode()
    key = key_of(topic, g).encode()
    return [
        Draft("first", key, value, Expect.TOLERATED),
        Draft("again", key, value, Expect.TOLERATED),
    ]


def _out_of_order(ctx: Context, topic: str, g: Ghost) -> list[Draft]:
    """The later event first, from the far future; then the earlier one, from long ago."""
    later = Ghost(**{**g.__dict__, "attempt": g.attempt + 1})
    first = _env(ctx, topic, ghost_payload(topic, later), occurred_at=FAR_FUTURE)
    second = _env(ctx, topic, ghost_payload(topic, g), occurred_at=LONG_AGO)
    key = key_of(topic, g).encode()
    return [
        Draft("later-first", key, dump(first).encode(), Expect.TOLERATED),
        Draft("earlier-second", key, dump(second).encode(), Expect.TOLERATED),
    ]


def _cancel_before_job(ctx: Context, g: Ghost, partition: int) -> tuple[list[Draft], LateJob]:
    """A cancel for a job that is only submitted later, with the valid traffic: the queue keeps
    it and cancels the job on arrival. The job runs for hours otherwise, so only the cancel
    can end it in time."""
    job_id = f"{ctx.tag}-late"
    cancel = _env(ctx, topics.JOB_CANCEL_REQUESTED, {"job_id": job_id, "requested_by": "fuzz"})
    spec = {
        "job_id": job_id,
        "tenant": g.tenant,
        "name": "fuzz-cancelled-early",
        "resources": {"accelerators": 1, "accelerator_types": ["A100"]},
        "labels": {"sim_duration_s": "3600000"},
    }
    late = LateJob(job_id, partition, dump(spec).encode(), "canceled")
    draft = Draft(
        "cancel-before-job",
        job_id.encode(),
        dump(cancel).encode(),
        Expect.ANSWERED,
        job_id=job_id,
        event_id=cancel["event_id"],
        outcome="canceled",
    )
    return [draft], late


GENERIC_CLASSES: dict[HostileClass, Builder] = {
    HostileClass.UNPARSEABLE: _unparseable,
    HostileClass.WRONG_TYPES: _wrong_types,
    HostileClass.NAN_INFINITY: _nan_infinity,
    HostileClass.CONTROL_CHARS: _control_chars,
    HostileClass.OVERSIZED: _oversized,
    HostileClass.DEEP_NESTING: _deep_nesting,
    HostileClass.UNKNOWN_TYPE: _unknown_type,
    HostileClass.UNKNOWN_ENTITY: _unknown_entity,
    HostileClass.DUPLICATE: _duplicate,
    HostileClass.OUT_OF_ORDER: _out_of_order,
}
