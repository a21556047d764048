"""The fuzz's diagnosis of a job it found no answer for (bench/fuzz_audit.py `locate`), on a
real broker: where the job's records are, read afresh, and why the audit passed them by."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from bench.fuzz_audit import Coords, Tail, locate
from tests.integration.kafka_tools import START_S, STOP_S, bounded, fresh_topic

pytestmark = pytest.mark.integration


def envelope(event_id: str, job_id: str) -> bytes:
    payload = {"job_id": job_id, "outcome": "succeeded"}
    return json.dumps({"event_id": event_id, "type": "JobFinished", "payload": payload}).encode()


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
                (1, envelope("e-read", "job-a")),  # the same event again: a redelivery
                (0, envelope("e-unread", "job-e")),
            )
        ]
    finally:
        await bounded(producer.stop(), STOP_S, "the test producer's stop")
    coords: dict[bytes, list[Coords]] = {}
    for meta, value in sent:
        coords.setdefault(value, []).append((topic, meta.partition, meta.offset))
    first, again = coords[envelope("e-read", "job-a")]
    (hostile,) = coords[envelope("e-hostile", "job-b")]
    (other,) = coords[envelope("e-other", "job-c")]
    (unread,) = coords[envelope("e-unread", "job-e")]

    def at(c: Coords) -> str:
        return f"{c[0]}[{c[1]}]@{c[2]}"

    found = await locate(
        kafka_bootstrap,
        topic,
        {"job-a", "job-b", "job-d", "job-e"},
        skip={hostile},
        seen={"e-read": first, "e-other": other},
        timeout_s=60,
    )

    assert found == {
        "job-a": [
            f"{at(first)} outcome 'succeeded' event e-read: read by the audit here",
            f"{at(again)} outcome 'succeeded' event e-read: skipped: its event id was first "
            f"read at {at(first)}",
        ],
        "job-b": [
            f"{at(hostile)} outcome 'succeeded' event e-hostile: skipped: at our hostile "
            "records' coordinates"
        ],
        "job-d": [],  # nothing about it in the topic: no line
        "job-e": [f"{at(unread)} outcome 'succeeded' event e-unread: never read by the audit"],
    }


class OneAtATime:
    """The audit's consumer, handing out one record per poll, and cancelling the read that
    polls again once it has handed out `cancel_after` records: a watcher stopped mid-read."""

    def __init__(self, consumer: Any, cancel_after: int) -> None:
        self._consumer = consumer
        self._cancel_after = cancel_after
        self.handed = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)

    async def getmany(
        self, *parts: Any, timeout_ms: int = 0, max_records: int | None = None
    ) -> Any:
        if self.handed >= self._cancel_after:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)  # the cancellation lands here, inside the read
        got = await self._consumer.getmany(*parts, timeout_ms=timeout_ms, max_records=1)
        self.handed += sum(len(records) for records in got.values())
        return got


async def test_a_read_cancelled_half_way_loses_nothing(kafka_bootstrap: str) -> None:
    """The fuzz stops its watcher while records are still being written, perhaps in the
    middle of a read: what that read had taken from the broker must reach the next one, or
    those jobs' ends are never seen (a CI failure: seventeen valid jobs 'never read by the
    audit', their job.finished records in one window on every partition)."""
    topic = await fresh_topic(kafka_bootstrap, "fuzz-tail", partitions=2)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await bounded(producer.start(), START_S, "the test producer's start")
    try:
        for i in range(6):
            await producer.send_and_wait(topic, envelope(f"e-{i}", f"job-{i}"), partition=i % 2)
    finally:
        await bounded(producer.stop(), STOP_S, "the test producer's stop")

    async with Tail(kafka_bootstrap, (topic,), set()) as tail:
        slow = OneAtATime(tail._consumer, cancel_after=3)
        tail._consumer = slow  # type: ignore[assignment]
        first = asyncio.create_task(tail.read(60))
        with pytest.raises(asyncio.CancelledError):
            await first
        assert slow.handed == 3  # taken from the broker by the read that was cancelled
        slow._cancel_after = 1_000
        rest = await tail.read(60)

    assert sorted(env["event_id"] for _, env in rest) == [f"e-{i}" for i in range(6)]
