"""Hostile records for `job.submitted`, the topic other platforms write to: bare job specs and
envelopes, wrong in every class's way. A submission the queue cannot take must be answered
(dead letter, and a `job.rejected` with a reason code when a job id can be recovered); one it
may take (a duplicate, an odd timestamp) must run once and end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.fuzz_ghosts import Ghost
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

FAR_FUTURE = "9999-12-31T23:59:59+00:00"
LONG_AGO = "0001-01-01T00:00:00+00:00"
EPOCH = "1970-01-01T00:00:00+00:00"


def valid_spec(job_id: str, tenant: str, accelerator_type: str = "A100") -> dict[str, Any]:
    """A small, short job (60 fleet seconds) that fits anywhere its type exists."""
    return {
        "job_id": job_id,
        "tenant": tenant,
        "name": "fuzz",
        "resources": {"accelerators": 1, "accelerator_types": [accelerator_type]},
        "labels": {"sim_duration_s": "60"},
    }


def _spec(ctx: Context, g: Ghost) -> dict[str, Any]:
    # A100: every tenant of the example policy has a quota of it, so the job can run.
    return valid_spec(ctx.tag, g.tenant)


def _wrapped(ctx: Context, spec: Any, **over: Any) -> dict[str, Any]:
    return envelope("JobSubmitted", spec, ctx.event_id(), ctx.at, **over)


def _refused(
    ctx: Context, name: str, value: bytes | None, job_id: str | None, *reasons: str
) -> Draft:
    return Draft(name, (job_id or ctx.tag).encode(), value, Expect.REFUSED, job_id, None, reasons)


def _unparseable(ctx: Context, g: Ghost) -> list[Draft]:
    whole = dump(_spec(ctx, g))
    variants: list[tuple[str, bytes | None]] = [
        ("empty", b""),
        ("null-value", None),
        ("binary", b"\xff\xfe" + bytes(ctx.rng.getrandbits(8) for _ in range(64))),
        ("truncated", truncated(whole, ctx.rng)),
        ("unquoted-keys", b"{job_id: 1, tenant: vision}"),
    ]
    name, value = ctx.pick(variants)
    draft = _refused(ctx, name, value, None)
    return [Draft(**{**draft.fields(), "key": garbage_key(ctx.rng)})] if ctx.turn % 2 else [draft]


def _wrong_types(ctx: Context, g: Ghost) -> list[Draft]:
    spec = _spec(ctx, g)
    job_id = spec["job_id"]
    variants: list[tuple[str, Any, str | None]] = [
        ("json-array", [spec], None),
        ("json-number", 42, None),
        ("tenant-number", {**spec, "tenant": 42}, job_id),
        ("resources-string", {**spec, "resources": "lots"}, job_id),
        ("replicas-word", {**spec, "replicas": "two"}, job_id),
        ("labels-list", {**spec, "labels": ["sim_duration_s", "60"]}, job_id),
        ("envelope-payload-string", _wrapped(ctx, dump(spec)), None),
    ]
    name, doc, recoverable = ctx.pick(variants)
    return [_refused(ctx, name, dump(doc).encode(), recoverable)]


def _nan_infinity(ctx: Context, g: Ghost) -> list[Draft]:
    spec = _spec(ctx, g)
    res = spec["resources"]
    nan, inf = float("nan"), float("inf")
    variants: list[tuple[str, dict[str, Any]]] = [
        ("nan-accelerators", {**spec, "resources": {**res, "accelerators": nan}}),
        ("infinity-cpu", {**spec, "resources": {**res, "cpu": inf}}),
        ("infinity-max-runtime", {**spec, "max_runtime_s": inf}),
        ("nan-memory", {**spec, "resources": {**res, "memory_gb": nan}}),
        (
            "infinity-accelerator-memory",
            {**spec, "resources": {**res, "accelerator_memory_gb": inf}},
        ),
    ]
    name, doc = ctx.pick(variants)
    return [_refused(ctx, name, dump(doc).encode(), spec["job_id"])]


def _control_chars(ctx: Context, g: Ghost) -> list[Draft]:
    spec = _spec(ctx, g)
    job_id = spec["job_id"]
    variants: list[tuple[str, bytes, str | None]] = [
        ("nul-in-job-id", dump({**spec, "job_id": f"{job_id}\x00"}).encode(), None),
        ("bidi-in-tenant", dump({**spec, "tenant": f"{g.tenant}\u202e"}).encode(), job_id),
        ("nul-in-name", dump({**spec, "name": "fuzz\x00name"}).encode(), job_id),
        (
            "escape-in-label",
            dump({**spec, "labels": {"x": "\x1b[2J", **spec["labels"]}}).encode(),
            job_id,
        ),
        ("isolate-in-user", dump({**spec, "user": "fuzz\u2066user"}).encode(), job_id),
        ("nul-in-command", dump({**spec, "command": ["run", "a\x00b"]}).encode(), job_id),
        (
            "raw-nul-byte",
            dump({**spec, "name": "RAWNUL"}).replace("RAWNUL", "a\x00b").encode(),
            job_id,
        ),
    ]
    name, value, recoverable = ctx.pick(variants)
    return [_refused(ctx, name, value, recoverable)]


def _oversized(ctx: Context, g: Ghost) -> list[Draft]:
    spec = _spec(ctx, g)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("huge-label", {**spec, "labels": {**spec["labels"], "blob": HOLE}}),
        ("huge-command", {**spec, "command": ["echo", HOLE]}),
        ("huge-unknown-field", {**spec, "fuzz_padding": HOLE}),
        ("huge-envelope", _wrapped(ctx, {**spec, "fuzz_padding": HOLE})),
    ]
    name, doc = ctx.pick(variants)
    value = padded(dump(doc), ctx.oversize_bytes, ctx.rng)
    return [_refused(ctx, name, value, spec["job_id"])]


def _deep_nesting(ctx: Context, g: Ghost) -> list[Draft]:
    spec = {**_spec(ctx, g), "fuzz_tree": HOLE}
    variants = [("arrays-64", 64, "["), ("objects-64", 64, "{"), ("arrays-100k", 100_000, "[")]
    variants.append(("objects-100k", 100_000, "{"))
    name, depth, kind = ctx.pick(variants)
    value = deep(dump(spec), depth, kind)
    return [_refused(ctx, name, value, spec["job_id"])]


def _unknown_type(ctx: Context, g: Ghost) -> list[Draft]:
    spec = _spec(ctx, g)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("unknown-type", {**_wrapped(ctx, spec), "type": "FuzzLaunchMissiles"}),
        ("other-event-type", {**_wrapped(ctx, spec), "type": "JobFinished"}),
        ("future-version", _wrapped(ctx, spec, version=99)),
    ]
    name, doc = ctx.pick(variants)
    return [
        Draft(name, ctx.tag.encode(), dump(doc).encode(), Expect.NOT_RUN, job_id=spec["job_id"])
    ]


def _unknown_entity(ctx: Context, g: Ghost) -> list[Draft]:
    spec = _spec(ctx, g)
    res = spec["resources"]
    variants: list[tuple[str, dict[str, Any], str]] = [
        ("unknown-tenant", {**spec, "tenant": "fuzz-nobody"}, "unknown_tenant"),
        ("unknown-queue", {**spec, "queue": "fuzz-nowhere"}, "unknown_queue"),
        ("unknown-priority", {**spec, "priority_class": "fuzz-urgent"}, "unknown_priority_class"),
        (
            "unknown-accelerator",
            {**spec, "resources": {**res, "accelerator_types": ["FUZZ-X"]}},
            "unknown_accelerator_type",
        ),
        (
            "gang-beyond-limits",
            # over every tenant's max_replicas (128 at most), under any schema bound
            {**spec, "replicas": 1000, "resources": {**res, "accelerators": 8}},
            "gang_too_large",
        ),
    ]
    name, doc, reason = ctx.pick(variants)
    extra = ("too_many_accelerators",) if reason == "gang_too_large" else ()
    return [_refused(ctx, name, dump(doc).encode(), spec["job_id"], reason, *extra)]


def _duplicate(ctx: Context, g: Ghost) -> list[Draft]:
    """Pairs: the first is a valid job that must run once; the second either changes nothing
    or is rejected for what it repeats."""
    spec = _spec(ctx, g)
    job_id = spec["job_id"]
    key = job_id.encode()

    def answered(name: str, value: bytes, jid: str = job_id) -> Draft:
        return Draft(name, key, value, Expect.ANSWERED, job_id=jid)

    turn = ctx.turn % 4
    if turn == 0:  # the same bare spec twice
        value = dump(spec).encode()
        return [answered("bare-first", value), answered("bare-again", value)]
    if turn == 1:  # the same envelope (same event id) twice
        value = dump(_wrapped(ctx, spec)).encode()
        return [answered("envelope-first", value), answered("envelope-again", value)]
    if turn == 2:  # the same job id from another tenant
        other = next(t for t in ("vision", "nlp", "speech") if t != spec["tenant"])
        second = _wrapped(ctx, {**spec, "tenant": other})
        return [
            answered("job-id-first", dump(spec).encode()),
            Draft(
                "job-id-other-tenant",
                key,
                dump(second).encode(),
                Expect.REFUSED,
                event_id=second["event_id"],
                reasons=("duplicate_job_id",),
            ),
        ]
    # the same idempotency key on two job ids: the second names the first
    first = {**spec, "idempotency_key": f"{ctx.tag}-idem"}
    second = {**first, "job_id": f"{job_id}-b"}
    return [
        answered("idempotency-first", dump(first).encode()),
        Draft(
            "idempotency-again",
            key,
            dump(second).encode(),
            Expect.REFUSED,
            job_id=second["job_id"],
            reasons=("duplicate_submission",),
        ),
    ]


def _out_of_order(ctx: Context, g: Ghost) -> list[Draft]:
    """Submissions that claim odd times (far future, the epoch, year 1): valid jobs all the
    same, which must run and end."""
    spec = _spec(ctx, g)
    when = ctx.pick([("far-future", FAR_FUTURE), ("epoch", EPOCH), ("year-one", LONG_AGO)])
    doc = _wrapped(ctx, spec, occurred_at=when[1])
    return [
        Draft(
            f"occurred-{when[0]}",
            ctx.tag.encode(),
            dump(doc).encode(),
            Expect.ANSWERED,
            job_id=spec["job_id"],
        )
    ]


SubmissionBuilder = Callable[[Context, Ghost], list[Draft]]
SUBMISSION_CLASSES: dict[HostileClass, SubmissionBuilder] = {
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
