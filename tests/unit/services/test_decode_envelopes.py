"""Decoding a batch: a scheduler leader's fence is no event and no poison. A consumer that
fences epochs gets it; every other consumer skips it; bad input still goes to dead.letter.
Decoded against the topics' payload models, a record in the current version is read in one
pass, and what is accepted, refused (and why) and read is what the usual way gives."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from aiokafka import ConsumerRecord
from pydantic import ValidationError

from bench.fuzz_records import generate_round
from bench.fuzz_topology import clusters_with_types, consumed_topics
from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobQueued,
    JobStarted,
    LeaderFence,
    PlacementDecided,
    ReplicaAssignment,
)
from schemas.job import JobSpec
from schemas.registry import _UPCASTERS, CURRENT_VERSION, Upcaster, register_upcaster
from schemas.validation import describe_validation_error
from services.common.deadletter import Received, decode_envelopes
from services.common.kafka import OutMessage, envelope_for


def record(value: bytes, offset: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic=topics.PLACEMENT_DECIDED,
        partition=0,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=None,
        value=value,
        checksum=None,
        serialized_key_size=0,
        serialized_value_size=len(value),
        headers=[],
    )


FENCE = Envelope(type=topics.LEADER_FENCE, payload={"epoch": 7, "leader": "s2"})
OTHER = Envelope(type="PlacementDecided", payload={"job_id": "j1"})
BATCH = (
    record(FENCE.model_dump_json().encode(), 0),
    record(OTHER.model_dump_json().encode(), 1),
    record(b"not json", 2),
)


def test_a_fence_goes_to_the_consumers_that_fence_and_nowhere_else() -> None:
    fences: list[LeaderFence] = []
    received, dead = decode_envelopes(BATCH, consumer="executor/c1", fences=fences)
    assert fences == [LeaderFence(epoch=7, leader="s2")]
    assert [r.envelope.type for r in received] == ["PlacementDecided"]
    assert len(dead) == 1

    received, dead = decode_envelopes(BATCH, consumer="queue")
    assert [r.envelope.type for r in received] == ["PlacementDecided"]
    assert len(dead) == 1  # only the bad record: the fence is skipped, not dead-lettered


# --- one pass with the topics' payload models (schemas.registry.parse_typed) -----------------

AT = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
MODELS = {t.name: t.payload for t in topics.TOPICS if t.payload is not None}


def on(topic: str, value: bytes | None, offset: int) -> ConsumerRecord[Any, Any]:
    return dataclasses.replace(record(value or b"", offset), topic=topic, value=value)


def hostile_batch() -> tuple[ConsumerRecord[Any, Any], ...]:
    """Every hostile class on every consumed topic (the fuzz's generator: ghost events that
    are valid, and every way of being invalid), with a valid job.queued and placement."""
    partitions = {t: 1 for t in consumed_topics()}
    drafts = generate_round(5, 0, partitions, clusters_with_types(), AT, 4096).records
    spec = JobSpec.model_validate({"job_id": "j-ok", "tenant": "vision"})
    valid = [
        (topics.JOB_QUEUED, JobQueued(job_id="j-ok", spec=spec, submitted_at=AT)),
        (
            topics.PLACEMENT_DECIDED,
            PlacementDecided(
                job_id="j-ok", attempt=1, epoch=1, leader="s", cluster="c1",
                accelerator_type="H100", spec=spec,
                replicas=[ReplicaAssignment(
                    replica=0, node_id="n0", accelerators=1, cpu=1, memory_gb=1, devices=[0]
                )],
            ),
        ),
    ]  # fmt: skip
    values = [(d.topic, d.value) for d in drafts] + [
        (topic, envelope_for(type(p).__name__, p, producer="t").model_dump_json().encode())
        for topic, p in valid
    ]
    return tuple(on(topic, value, i) for i, (topic, value) in enumerate(values))


def outcome(
    received: list[Received], dead: list[OutMessage]
) -> tuple[dict[int, object], dict[int, tuple[str, str]]]:
    """What a consumer ends up with: each accepted record's payload as its model validates it
    (or the validation error), and each dead letter's reason and error."""
    payloads: dict[int, object] = {}
    for got in received:
        try:
            payloads[got.record.offset] = MODELS[got.record.topic].model_validate(
                got.envelope.payload
            )
        except ValidationError as exc:
            payloads[got.record.offset] = describe_validation_error(exc)
    letters = {
        int(m.envelope.payload["offset"]): (
            m.envelope.payload["reason"],
            m.envelope.payload["error"],
        )
        for m in dead
    }
    return payloads, letters


def test_with_the_payload_models_what_is_accepted_refused_and_read_does_not_change() -> None:
    batch = hostile_batch()
    typed = decode_envelopes(batch, consumer="c", models=MODELS)
    usual = decode_envelopes(batch, consumer="c")
    assert outcome(*typed) == outcome(*usual)
    payloads, letters = outcome(*typed)
    # The comparison covered records of every kind: read in one pass, read the usual way after
    # the one pass refused them, and dead-lettered.
    one_pass = [g for g in typed[0] if not isinstance(g.envelope.payload, dict)]
    assert len(one_pass) >= len(consumed_topics())
    assert any(isinstance(p, str) for p in payloads.values())  # usual way, payload refused
    assert len(letters) > 10
    # The valid job.queued was read in one pass: its payload is the model itself.
    queued = next(g for g in typed[0] if g.record.offset == len(batch) - 2)
    assert isinstance(queued.envelope.payload, JobQueued)
    assert JobQueued.model_validate(queued.envelope.payload) is queued.envelope.payload


@contextlib.contextmanager
def upcaster(event_type: str, version: int, fn: Upcaster) -> Iterator[None]:
    """`fn` registered as the upcaster of `event_type` from `version` for the block only."""
    register_upcaster(event_type, version, fn)
    try:
        yield
    finally:
        _UPCASTERS.pop((event_type, version))
        CURRENT_VERSION.pop(event_type)


def test_an_older_version_is_lifted_and_a_newer_one_refused_the_usual_way() -> None:
    """One pass only reads the current version: an older one is lifted by its upcaster, even
    when it would validate as it is; a newer one is refused with the reason."""

    def lift(payload: dict[str, Any]) -> dict[str, Any]:
        lifted = dict(payload)
        if "id" in lifted:
            lifted["job_id"] = lifted.pop("id")
        lifted["cluster"] = f"lifted-{lifted['cluster']}"
        return lifted

    run = {"attempt": 1, "nodes": ["n0"], "started_at": AT.isoformat()}
    v1 = {"job_id": "j1", "cluster": "c1", **run}
    assert JobStarted.model_validate(v1)  # a v1 that validates as the current shape
    old = Envelope(type="JobStarted", version=1, payload={"id": "j0", "cluster": "c0", **run})
    looks_current = Envelope(type="JobStarted", version=1, payload=v1)
    newer = Envelope(type="JobStarted", version=3, payload=v1)
    batch = tuple(
        on(topics.JOB_STARTED, e.model_dump_json().encode(), i)
        for i, e in enumerate((old, looks_current, newer))
    )
    with upcaster("JobStarted", 1, lift):
        received, dead = decode_envelopes(batch, consumer="c", models=MODELS)
    assert [(g.envelope.version, g.envelope.payload) for g in received] == [
        (2, {"job_id": "j0", "cluster": "lifted-c0", **run}),
        (2, {"job_id": "j1", "cluster": "lifted-c1", **run}),
    ]
    assert [m.envelope.payload["offset"] for m in dead] == [2]
    assert "newer than this consumer reads" in dead[0].envelope.payload["error"]


def test_a_fence_is_a_fence_even_where_it_would_validate_as_the_topics_model() -> None:
    fences: list[LeaderFence] = []
    batch = (on(topics.JOB_STARTED, FENCE.model_dump_json().encode(), 0),)
    received, dead = decode_envelopes(
        batch, consumer="c", fences=fences, models={topics.JOB_STARTED: LeaderFence}
    )
    assert (received, dead, fences) == ([], [], [LeaderFence(epoch=7, leader="s2")])


def test_an_old_payload_its_upcaster_cannot_lift_is_dead_lettered_not_raised() -> None:
    """An upcaster that fails on a hostile old payload (here a KeyError: the field it renames
    is missing) refuses that record with the reason; the rest of the batch is read."""

    def rename(payload: dict[str, Any]) -> dict[str, Any]:
        lifted = dict(payload)
        lifted["job_id"] = lifted.pop("id")
        return lifted

    run = {"attempt": 1, "cluster": "c1", "nodes": ["n0"], "started_at": AT.isoformat()}
    lacking = Envelope(type="JobStarted", version=1, payload=run)
    good = Envelope(type="JobStarted", version=1, payload={"id": "j1", **run})
    batch = tuple(
        on(topics.JOB_STARTED, e.model_dump_json().encode(), i)
        for i, e in enumerate((lacking, good))
    )
    with upcaster("JobStarted", 1, rename):
        received, dead = decode_envelopes(batch, consumer="c", models=MODELS)
    assert [g.envelope.payload["job_id"] for g in received] == ["j1"]
    assert [m.envelope.payload["offset"] for m in dead] == [0]
    assert dead[0].envelope.payload["error"] == (
        "JobStarted v1 could not be lifted to v2: KeyError: 'id'"
    )
