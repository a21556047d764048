"""The fuzz's generator: the same seed gives the same records byte for byte, every consumed
topic gets every class on every partition, and what is meant to be valid (ghost events, the
jobs that must run) is valid, so a failure in the fuzz is the platform's and not the fuzz's."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel

from bench.fuzz_audit import Coords, Evidence, judge
from bench.fuzz_ghosts import GHOSTS, Ghost, ghost_payload
from bench.fuzz_records import HostileRecord, generate_round
from bench.fuzz_topology import clusters_with_types, consumed_topics, consumer_groups
from bench.fuzz_wire import Expect, HostileClass
from schemas import topics
from schemas.envelope import Envelope
from schemas.job import JobSpec

AT = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
PARTITIONS = {t: topics.BY_NAME[t].partitions for t in consumed_topics()}
CLUSTERS = clusters_with_types()
SMALL = 4096  # "oversized" records of a few KiB keep the unit test fast


def generate(seed: int, round_no: int = 0) -> list[HostileRecord]:
    return generate_round(seed, round_no, PARTITIONS, CLUSTERS, AT, SMALL).records


def test_same_seed_same_records_other_seed_other_records() -> None:
    assert generate(11) == generate(11)
    assert generate(11, round_no=1) == generate(11, round_no=1)
    assert [r.value for r in generate(11)] != [r.value for r in generate(12)]
    assert [r.value for r in generate(11)] != [r.value for r in generate(11, round_no=1)]


def test_every_consumed_topic_class_and_partition_is_covered() -> None:
    covered = {(r.topic, r.partition, r.cls) for r in generate(5)}
    wanted = {
        (topic, p, cls) for topic, n in PARTITIONS.items() for p in range(n) for cls in HostileClass
    }
    assert wanted - covered == set()


def test_consumed_topics_are_what_the_services_subscribe_to() -> None:
    subscribed = {t for names in consumer_groups().values() for t in names}
    assert subscribed <= set(consumed_topics())
    assert {topics.JOB_SUBMITTED, topics.NODE_HEARTBEAT, topics.USAGE_TICK} <= subscribed
    assert topics.DEAD_LETTER not in consumed_topics()


def test_malformed_classes_are_refused_and_sized_as_announced() -> None:
    records = generate_round(3, 0, PARTITIONS, CLUSTERS, AT, 3 << 20).records
    malformed = {
        HostileClass.UNPARSEABLE,
        HostileClass.WRONG_TYPES,
        HostileClass.NAN_INFINITY,
        HostileClass.CONTROL_CHARS,
        HostileClass.OVERSIZED,
        HostileClass.DEEP_NESTING,
    }
    for r in records:
        if r.cls in malformed:
            assert r.expect is Expect.REFUSED, r.label()
        if r.cls is HostileClass.OVERSIZED:
            assert r.value is not None and len(r.value) >= 3 << 20, r.label()
    deepest = max(
        (r for r in records if r.cls is HostileClass.DEEP_NESTING),
        key=lambda r: len(r.value or b""),
    )
    assert (deepest.value or b"").count(b"[") + (deepest.value or b"").count(b"{") > 100_000


@pytest.mark.parametrize("topic", sorted(set(PARTITIONS) - {topics.JOB_SUBMITTED}))
def test_ghost_events_are_valid_for_their_topic(topic: str) -> None:
    assert topic in GHOSTS, f"no valid-looking builder for {topic}"
    model = topics.BY_NAME[topic].payload
    assert model is not None and issubclass(model, BaseModel)
    ghost = Ghost("j", "n", "onprem-h100", "H100", "nowhere", "vision", "outsider", 1, AT)
    model.model_validate(ghost_payload(topic, ghost))
    for r in generate(9):
        if r.topic == topic and r.cls is HostileClass.UNKNOWN_ENTITY:
            env = Envelope.model_validate_json(r.value or b"")
            assert env.type == topics.BY_NAME[topic].event_type
            model.model_validate(env.payload)


def test_jobs_meant_to_run_are_valid_specs() -> None:
    records = generate(4)
    runnable = [
        r
        for r in records
        if r.topic == topics.JOB_SUBMITTED and r.expect is Expect.ANSWERED and r.value
    ]
    assert {r.cls for r in runnable} == {HostileClass.DUPLICATE, HostileClass.OUT_OF_ORDER}
    for r in runnable:
        doc = json.loads(r.value or b"")
        JobSpec.model_validate(doc.get("payload", doc))
    late = generate_round(4, 0, PARTITIONS, CLUSTERS, AT, SMALL).late_jobs
    assert len(late) == PARTITIONS[topics.JOB_CANCEL_REQUESTED]
    for job in late:
        assert JobSpec.model_validate_json(job.value).job_id == job.job_id


def test_pairs_stay_together_and_in_order() -> None:
    records = generate(6)
    for i, r in enumerate(records):
        if r.variant in ("again", "earlier-second"):
            before = records[i - 1]
            assert (before.topic, before.partition, before.cls) == (r.topic, r.partition, r.cls)
    assert (
        Counter(r.variant for r in records)["again"] == Counter(r.variant for r in records)["first"]
    )


def test_verdicts_need_a_dead_letter_or_a_rejection() -> None:
    record = next(
        r
        for r in generate(2)
        if r.topic == topics.JOB_FINISHED and r.cls is HostileClass.UNPARSEABLE
    )
    coords: Coords = (record.topic, record.partition, 17)
    ev = Evidence()
    assert not judge(record, coords, ev).ok
    letter = {"source_topic": record.topic, "partition": record.partition, "offset": 17}
    ev.add([((topics.DEAD_LETTER, 0, 0), {"event_id": "d1", "payload": letter})])
    assert judge(record, coords, ev).ok
    assert judge(record, coords, ev).how == "dead_lettered"


def record(expect: Expect, **fields: Any) -> HostileRecord:
    base: dict[str, Any] = {
        "topic": topics.JOB_SUBMITTED,
        "partition": 1,
        "cls": HostileClass.DUPLICATE,
        "round": 0,
        "variant": "v",
        "key": None,
        "value": b"{}",
        "expect": expect,
    }
    return HostileRecord(**{**base, **fields})


def answer(topic: str, event_id: str, **payload: Any) -> tuple[Coords, dict[str, Any]]:
    env = {"event_id": event_id, "payload": payload, "causation_id": payload.pop("cause", None)}
    return (topic, 0, 0), env


@pytest.mark.parametrize(
    ("expect", "fields", "answers", "problem"),
    [
        # a submission that must run: ended, with the outcome asked for, queued once
        (Expect.ANSWERED, {"job_id": "j"}, [], "never reached a terminal state"),
        (
            Expect.ANSWERED,
            {"job_id": "j", "outcome": "canceled"},
            [answer(topics.JOB_FINISHED, "f", job_id="j", outcome="succeeded")],
            "ended succeeded, expected canceled",
        ),
        (
            Expect.ANSWERED,
            {"job_id": "j"},
            [
                answer(topics.JOB_QUEUED, "q1", job_id="j", attempt=0),
                answer(topics.JOB_QUEUED, "q2", job_id="j", attempt=0),
                answer(topics.JOB_FINISHED, "f", job_id="j", outcome="succeeded"),
            ],
            "queued 2 times",
        ),
        (
            Expect.ANSWERED,
            {"job_id": "j"},
            [
                answer(topics.JOB_QUEUED, "q1", job_id="j", attempt=0),
                answer(topics.JOB_QUEUED, "q1", job_id="j", attempt=0),  # redelivered
                answer(topics.JOB_QUEUED, "q3", job_id="j", attempt=1),  # a requeue
                answer(topics.JOB_FINISHED, "f", job_id="j", outcome="succeeded"),
            ],
            None,
        ),
        # refusals: by job id, by cause, with the reason asked for
        (
            Expect.REFUSED,
            {"job_id": "j"},
            [answer(topics.JOB_REJECTED, "r", job_id="j", reason_code="invalid_spec")],
            None,
        ),
        (
            Expect.REFUSED,
            {"event_id": "e", "reasons": ("duplicate_job_id",)},
            [answer(topics.JOB_REJECTED, "r", reason_code="duplicate_job_id", cause="e")],
            None,
        ),
        (
            Expect.REFUSED,
            {"job_id": "j", "reasons": ("unknown_queue",)},
            [answer(topics.JOB_REJECTED, "r", job_id="j", reason_code="unknown_tenant")],
            "expected one of ['unknown_queue']",
        ),
        (
            Expect.REFUSED,
            {"job_id": "j"},
            [answer(topics.JOB_QUEUED, "q", job_id="j", attempt=0)],
            "accepted and queued",
        ),
        # an unknown type may be ignored, never run
        (Expect.NOT_RUN, {"job_id": "j"}, [], None),
        (
            Expect.NOT_RUN,
            {"job_id": "j"},
            [answer(topics.JOB_QUEUED, "q", job_id="j", attempt=0)],
            "acted on",
        ),
        (Expect.TOLERATED, {"topic": topics.NODE_PROBE}, [], None),
    ],
)
def test_verdicts(
    expect: Expect,
    fields: dict[str, Any],
    answers: list[tuple[Coords, dict[str, Any]]],
    problem: str | None,
) -> None:
    ev = Evidence()
    ev.add(answers)
    verdict = judge(record(expect, **fields), (topics.JOB_SUBMITTED, 1, 5), ev)
    if problem is None:
        assert verdict.ok, verdict.problem
    else:
        assert verdict.problem is not None and problem in verdict.problem
