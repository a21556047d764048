"""The fuzz's diagnosis of a job it found no answer for (bench/fuzz_audit.py `locate`), on a
real broker: where the job's records are, read afresh, and why the audit passed them by."""

from __future__ import annotations

import json

import pytest
from aiokafka import AIOKafkaProducer

from bench.fuzz_audit import Coords, locate
from tests.integration.kafka_tools import START_S, STOP_S, bounded, fresh_topic

pytestmark = pytest.mark.integration


def envelope(event_id: str, job_id: str) -> bytes:
    return json.dumps(
        {"event_id": event_id, "type": "JobFinished", "payload": {"job_id": job_id}}
    ).encode()


async def test_locate_finds_each_jobs_records_and_says_why_the_audit_passed_them_by(
    kafka_bootstrap: str,
) -> None:
    topic = await fresh_topic(kafka_bootstrap, "fuzz-audit", partitions=2)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await bounded(producer.start(), START_S, "the test producer's start")
    try:
        sent = [
            (await producer.send_and_wait(topic, value, partition=p), value)
            for p, value in (
                (0, envelope("e-read", "job-a")),
                (1, b"\x00{not json"),  # what a hostile producer writes: passed over
                (1, envelope("e-hostile", "job-b")),
                (0, envelope("e-other", "job-c")),
                (1, b'{"payload": "not an object"}'),
                (0, b'{"event_id": "e-list", "payload": {"job_id": ["job-a"]}}'),  # unhashable
            )
        ]
    finally:
        await bounded(producer.stop(), STOP_S, "the test producer's stop")
    coords: dict[bytes, Coords] = {v: (topic, m.partition, m.offset) for m, v in sent}
    hostile = coords[envelope("e-hostile", "job-b")]

    found = await locate(
        kafka_bootstrap, topic, {"job-a", "job-b", "job-d"}, skip={hostile}, seen={"e-read"}
    )

    assert set(found) == {"job-a", "job-b", "job-d"}
    a_topic, a_partition, a_offset = coords[envelope("e-read", "job-a")]
    assert found["job-a"] == [
        f"{a_topic}[{a_partition}]@{a_offset} event e-read event id read before"
    ]
    assert found["job-b"] == [
        f"{topic}[{hostile[1]}]@{hostile[2]} event e-hostile at hostile coordinates, "
        "event id never read"
    ]
    assert found["job-d"] == []  # nothing about it in the topic: no line
