"""Scheduler snapshots on a real broker, PostgreSQL and Redis: a scheduler that starts after one
was taken resumes from it and reads only the records after it, holds what a full replay holds,
and places nothing twice; a snapshot of another log (a broker started afresh) or one that
cannot be read is set aside, and the topics are replayed instead."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer
from fastapi import FastAPI

from cli.infra import free_port
from schemas import topics
from schemas.envelope import Envelope
from schemas.events import JobFinished, JobQueued, Outcome
from services.common.topics import ensure_topics
from services.scheduler.app import create_app
from services.scheduler.feed import verify_marks
from services.scheduler.persist import Snapshots
from services.scheduler.settings import SchedulerSettings
from services.scheduler.state import SchedulerState
from tests.conftest import private_kafka
from tests.integration.conftest import running
from tests.integration.kafka_tools import START_S, STOP_S, bounded
from tests.integration.test_scheduler_fencing import produce, read_until
from tests.unit.services.builders import T0, spec
from tests.unit.services.test_scheduler_state import capacity


@pytest.fixture
async def own_kafka(tmp_path: Path) -> AsyncIterator[str]:
    with private_kafka(tmp_path / "kafka") as url:
        await ensure_topics(url)
        yield url


def queued(job_id: str) -> Envelope:
    event = JobQueued(job_id=job_id, spec=spec(job_id=job_id), submitted_at=T0)
    return Envelope(type="JobQueued", payload=event.model_dump(mode="json"))


async def fill(bootstrap: str, jobs: list[str]) -> None:
    await produce(
        bootstrap,
        topics.CLUSTER_CAPACITY,
        Envelope(type="ClusterCapacity", payload=capacity(2).model_dump(mode="json")),
    )
    for job_id in jobs:
        await produce(bootstrap, topics.JOB_QUEUED, queued(job_id))


def placements(found: list[Any]) -> Counter[str]:
    return Counter(
        env["payload"]["job_id"]
        for topic, *_, env in found
        if topic == topics.PLACEMENT_DECIDED and env["type"] == "PlacementDecided"
    )


def metric(app: FastAPI, name: str) -> float | None:
    value = app.state.runtime.registry.get_sample_value(name)
    return None if value is None else float(value)


async def eventually(holds: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Waits (polling: the state has no event to wait on) until `holds()`."""
    async with asyncio.timeout(timeout_s):
        while not holds():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def caught_up(app: FastAPI, timeout_s: float = 60.0) -> None:
    await eventually(lambda: metric(app, "qm_scheduler_caught_up") == 1, timeout_s)


def settings_for(
    bootstrap: str, env: dict[str, Any], lease: str, **extra: Any
) -> SchedulerSettings:
    base = {**env, "kafka_bootstrap": bootstrap}
    return SchedulerSettings(**base, lease_name=lease, snapshot_every_s=3600.0, **extra)


def held(state: SchedulerState) -> dict[str, Any]:
    """What a snapshot must carry over, in comparable form."""
    return {
        "pending": sorted(state.pending),
        "running": {j: (a.cluster, a.replicas) for j, a in state.running.items()},
        "attempts": dict(state.attempts),
        "finished": sorted(state.finished),
        "nodes": sorted(state.nodes),
    }


async def test_a_start_resumes_from_the_snapshot_and_reads_only_the_rest(
    own_kafka: str, service_env: dict[str, Any]
) -> None:
    run = uuid.uuid4().hex[:8]
    lease = f"qm:test:snap:{run}"
    first = [f"{run}-a{i}" for i in range(4)]
    await fill(own_kafka, first)

    leader = create_app(settings_for(own_kafka, service_env, lease))
    async with running(leader):
        await read_until(own_kafka, lambda found: set(placements(found)) >= set(first))
        await caught_up(leader)
        # The leader has applied its four placements (as acknowledged): the snapshot holds them.
        await eventually(lambda: len(leader.state.scheduler.running) >= 4)
        assert await leader.state.snapshots.take(force=True)
        records_before = leader.state.snapshots.feed.records
    assert metric(leader, "qm_scheduler_resumed_from_snapshot") in (None, 0)

    # While no scheduler runs: one job ends, two arrive.
    ended = JobFinished(job_id=first[0], outcome=Outcome.SUCCEEDED, attempt=1)
    await produce(
        own_kafka,
        topics.JOB_FINISHED,
        Envelope(type="JobFinished", payload=ended.model_dump(mode="json")),
    )
    later = [f"{run}-b{i}" for i in range(2)]
    for job_id in later:
        await produce(own_kafka, topics.JOB_QUEUED, queued(job_id))

    successor = create_app(settings_for(own_kafka, service_env, lease))
    async with running(successor):
        await caught_up(successor)
        assert metric(successor, "qm_scheduler_resumed_from_snapshot") == 1
        # It read the records after the snapshot, not the log again.
        assert successor.state.snapshots.feed.records < records_before
        found = await read_until(own_kafka, lambda f: set(placements(f)) >= set(first + later))
        await eventually(lambda: len(successor.state.scheduler.running) >= 5)
        # A replica replaying the whole log (standing by: the lease is held) holds the same.
        replay = create_app(settings_for(own_kafka, service_env, lease, snapshots=False))
        async with running(replay):
            await caught_up(replay)
            try:
                await eventually(
                    lambda: held(replay.state.scheduler) == held(successor.state.scheduler)
                )
            except TimeoutError:
                a, b = held(replay.state.scheduler), held(successor.state.scheduler)
                raise AssertionError({k: (a[k], b[k]) for k in a if a[k] != b[k]}) from None
            assert metric(replay, "qm_scheduler_resumed_from_snapshot") in (None, 0)
    counts = placements(found)
    assert all(counts[j] == 1 for j in first + later), counts  # nothing placed twice
    assert first[0] not in successor.state.scheduler.running


async def test_a_snapshot_of_another_log_or_unreadable_is_set_aside(
    tmp_path: Path, service_env: dict[str, Any]
) -> None:
    run = uuid.uuid4().hex[:8]
    lease = f"qm:test:snap:{run}"
    with private_kafka(tmp_path / "old") as old:
        await ensure_topics(old)
        await fill(old, [f"{run}-old{i}" for i in range(3)])
        app = create_app(settings_for(old, service_env, lease))
        async with running(app):
            await caught_up(app)
            await eventually(lambda: len(app.state.scheduler.running) >= 3)
            assert await app.state.snapshots.take(force=True)

    # The broker started afresh (as a development stack does); the database kept the snapshot.
    with private_kafka(tmp_path / "new") as new:
        await ensure_topics(new)
        fresh_jobs = [f"{run}-new{i}" for i in range(2)]
        await fill(new, fresh_jobs)
        app = create_app(settings_for(new, service_env, lease))
        async with running(app):
            await caught_up(app)
            assert metric(app, "qm_scheduler_resumed_from_snapshot") in (None, 0)
            await eventually(lambda: set(app.state.scheduler.running) == set(fresh_jobs))
            assert not any("old" in j for j in app.state.scheduler.queued)
            assert await app.state.snapshots.take(force=True)

        # A snapshot this version cannot read: replayed, and the start goes on.
        conn = await asyncpg.connect(service_env["database_url"])
        try:
            await conn.execute(
                "UPDATE scheduler.snapshots SET body = $1 WHERE name = $2", b"{not json", lease
            )
        finally:
            await conn.close()
        app = create_app(settings_for(new, service_env, lease))
        async with running(app):
            await caught_up(app)
            assert metric(app, "qm_scheduler_resumed_from_snapshot") in (None, 0)
            assert set(app.state.scheduler.running) == set(fresh_jobs)


async def test_marks_of_another_log_are_told_apart_by_their_records(tmp_path: Path) -> None:
    """Two brokers whose partitions are as long as each other: the record before each mark
    tells them apart; a partition the broker lacks is no match; a broker away is no verdict."""
    records = [("a" * n).encode() for n in (10, 20, 30)]
    marks = {}
    with private_kafka(tmp_path / "one") as one, private_kafka(tmp_path / "two") as two:
        for url, tail in ((one, b"x"), (two, b"yy")):
            await ensure_topics(url)
            producer = AIOKafkaProducer(bootstrap_servers=url)
            await bounded(producer.start(), START_S, "a test producer's start")
            try:
                for value in records:
                    meta = await producer.send_and_wait(
                        topics.JOB_QUEUED, value + tail, partition=0
                    )
            finally:
                await bounded(producer.stop(), STOP_S, "a test producer's stop")
            if url == one:
                marks = {
                    (topics.JOB_QUEUED, 0): (meta.offset + 1, meta.timestamp, len(value + tail))
                }
        assert (await verify_marks(one, marks)).matches is True
        other = await verify_marks(two, marks)
        assert other.matches is False and "log has" in other.why
        absent = await verify_marks(one, {**marks, (topics.JOB_QUEUED, 99): (1, 0, 1)})
        assert absent.matches is False and "no partition" in absent.why
    away = await verify_marks(f"127.0.0.1:{free_port()}", marks, timeout_s=2)
    assert away.matches is None


class TruncatedFor(Snapshots):
    """The broker here cannot delete records (Tansu answers no DeleteRecords), so the answer to
    "is the log truncated" is played: truncated for the first `times` questions."""

    def __init__(self, times: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.times = times
        self.asked = 0

    async def _truncated(self) -> list[str]:
        self.asked += 1
        return ["job.queued[0] from 5"] if self.asked <= self.times else []


async def test_without_a_snapshot_a_truncated_log_is_not_replayed(
    own_kafka: str, service_env: dict[str, Any]
) -> None:
    lease = f"qm:test:snap:{uuid.uuid4().hex[:8]}"
    app = create_app(settings_for(own_kafka, service_env, lease))
    snapshots: Snapshots = app.state.snapshots
    kwargs = {
        name: getattr(snapshots, name)
        for name in (
            "database_url",
            "name",
            "bootstrap",
            "state",
            "feed",
            "metrics",
            "holder",
            "every_s",
            "min_records",
            "leading",
            "topics",
        )
    }
    waiting = TruncatedFor(2, **kwargs)
    try:
        assert await waiting.load() is None  # only once the log was whole again
        assert waiting.asked == 3
    finally:
        await waiting.close()
    overridden = TruncatedFor(5, replay_truncated=True, **kwargs)
    try:
        assert await overridden.load() is None
        assert overridden.asked == 1  # replayed at once, knowingly
    finally:
        await overridden.close()
