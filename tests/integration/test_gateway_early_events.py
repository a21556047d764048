"""The gateway's projector on the real PostgreSQL and Redis when a job's lifecycle events are
read before the job itself: it reads every job topic on one consumer whose partitions are
fetched independently, so a placement or a start can come before the job.queued of a job
submitted on Kafka. Nothing read early may be lost, in one batch, over several, or with two
replicas projecting at once."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from pydantic import BaseModel
from redis.asyncio import Redis

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    JobPreempted,
    JobQueued,
    JobStarted,
    PlacementDecided,
    ReplicaAssignment,
)
from schemas.job import JobSpec, JobState
from services.common.db import create_pool
from services.gateway import store
from services.gateway.handlers import Projector
from tests.unit.gateway.builders import record

pytestmark = pytest.mark.integration

T0 = datetime(2026, 11, 1, tzinfo=UTC)
_offsets = itertools.count()


def spec(job_id: str) -> JobSpec:
    return JobSpec.model_validate(
        {"job_id": job_id, "tenant": "vision", "resources": {"accelerators": 2}}
    )


def rec(topic: str, payload: BaseModel, seconds: float, job_id: str) -> object:
    env = Envelope(
        type=type(payload).__name__,
        occurred_at=T0 + timedelta(seconds=seconds),
        payload=payload.model_dump(mode="json"),
    )
    return record(topic, env.model_dump_json().encode(), next(_offsets), job_id)


def queued(job_id: str) -> object:
    return rec(
        topics.JOB_QUEUED, JobQueued(job_id=job_id, spec=spec(job_id), submitted_at=T0), 1, job_id
    )


def placed(job_id: str) -> object:
    decided = PlacementDecided(
        job_id=job_id, attempt=1, epoch=1, leader="s", cluster="c1", accelerator_type="H100",
        spec=spec(job_id),
        replicas=[
            ReplicaAssignment(
                replica=0, node_id="n0", accelerators=2, cpu=1, memory_gb=1, devices=[2, 3]
            )
        ],
    )  # fmt: skip
    return rec(topics.PLACEMENT_DECIDED, decided, 5, job_id)


def started(job_id: str) -> object:
    run = JobStarted(job_id=job_id, attempt=1, cluster="c1", nodes=["n0"], started_at=T0)
    return rec(topics.JOB_STARTED, run, 9, job_id)


def preempted(job_id: str) -> object:
    stop = JobPreempted(
        job_id=job_id, attempt=1, cluster="c1", reason_code="preempted_for_priority", message="m"
    )
    return rec(topics.JOB_PREEMPTED, stop, 30, job_id)


@pytest.fixture
async def rig(fresh_database_url: str, redis_url: str) -> AsyncIterator[tuple[asyncpg.Pool, Redis]]:
    pool = await create_pool(fresh_database_url)
    redis = Redis.from_url(redis_url)
    try:
        await store.migrate_gateway(pool)
        yield pool, redis
    finally:
        await redis.aclose()
        await pool.close()


async def view(pool: asyncpg.Pool, job_id: str) -> asyncpg.Record | None:
    return await pool.fetchrow(
        "SELECT state, attempt, placement FROM gateway.jobs WHERE job_id = $1", job_id
    )


async def kept(pool: asyncpg.Pool) -> list[str]:
    rows = await pool.fetch("SELECT job_id FROM gateway.early_events ORDER BY job_id")
    return [r["job_id"] for r in rows]


async def test_events_read_before_the_job_are_folded_in_once_it_is_known(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    pool, redis = rig
    projector = Projector(pool, redis)

    # Over batches: the placement and the start come first and wait.
    await projector.process((placed("j-late"), started("j-late")))  # type: ignore[arg-type]
    assert await view(pool, "j-late") is None
    assert await kept(pool) == ["j-late", "j-late"]
    await projector.process((queued("j-late"),))  # type: ignore[arg-type]
    row = await view(pool, "j-late")
    assert row is not None and (row["state"], row["attempt"]) == (JobState.RUNNING.value, 1)
    assert row["placement"] is not None and '"devices": [2, 3]' in row["placement"]
    assert await kept(pool) == []

    # In one batch, the placement ahead of the job.queued.
    await projector.process((placed("j-batch"), queued("j-batch")))  # type: ignore[arg-type]
    row = await view(pool, "j-batch")
    assert row is not None and row["state"] == JobState.PLACED.value
    assert await kept(pool) == []

    # The timeline holds every event once, the early ones included.
    events = await pool.fetch(
        "SELECT type FROM gateway.job_events WHERE job_id = 'j-late' ORDER BY at"
    )
    assert [e["type"] for e in events] == ["JobQueued", "PlacementDecided", "JobStarted"]


async def test_two_replicas_racing_lose_no_early_event(rig: tuple[asyncpg.Pool, Redis]) -> None:
    """One replica reads the job.queued, the other the placement, at the same moment: whichever
    commits first, the job ends up placed and nothing stays kept."""
    pool, redis = rig
    a, b = Projector(pool, redis), Projector(pool, redis)
    for i in range(20):
        job_id = f"j-race-{i}"
        first, second = (a, b) if i % 2 else (b, a)
        await asyncio.gather(
            first.process((queued(job_id),)),  # type: ignore[arg-type]
            second.process((placed(job_id),)),  # type: ignore[arg-type]
        )
        row = await view(pool, job_id)
        assert row is not None and row["state"] == JobState.PLACED.value, job_id
    assert await kept(pool) == []


async def test_events_about_jobs_never_heard_of_are_dropped_after_a_day(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    pool, redis = rig
    projector = Projector(pool, redis)
    await projector.process((started("j-stray"),))  # type: ignore[arg-type]
    await pool.execute("UPDATE gateway.early_events SET received_at = now() - interval '25 hours'")
    await projector.process((started("j-other"),))  # type: ignore[arg-type]
    assert await kept(pool) == ["j-other"]


async def test_an_early_event_is_folded_in_its_time_not_after_the_batch(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    """[placement, job.queued, job.preempted] in one batch: the job is queued again with its
    run ended, not left placed (holding devices) by a placement folded in last."""
    pool, redis = rig
    projector = Projector(pool, redis)
    await projector.process((placed("j-order"), queued("j-order"), preempted("j-order")))  # type: ignore[arg-type]
    row = await pool.fetchrow(
        "SELECT state, ended_attempt FROM gateway.jobs WHERE job_id = 'j-order'"
    )
    assert row is not None and (row["state"], row["ended_attempt"]) == ("queued", 1)
    # The same with the placement kept from an earlier batch.
    await projector.process((placed("j-order2"),))  # type: ignore[arg-type]
    await projector.process((queued("j-order2"), preempted("j-order2")))  # type: ignore[arg-type]
    row = await pool.fetchrow(
        "SELECT state, ended_attempt FROM gateway.jobs WHERE job_id = 'j-order2'"
    )
    assert row is not None and (row["state"], row["ended_attempt"]) == ("queued", 1)


async def test_a_kept_event_that_cannot_be_read_again_is_dropped_not_fatal(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    pool, redis = rig
    projector = Projector(pool, redis)
    await pool.execute(
        "INSERT INTO gateway.early_events (event_id, job_id, topic, value)"
        " VALUES ('bad-1', 'j-bad', $1, $2)",
        topics.JOB_STARTED,
        b'{"not": "an envelope"}',
    )
    await projector.process((placed("j-bad"), queued("j-bad")))  # type: ignore[arg-type]
    row = await view(pool, "j-bad")
    assert row is not None and row["state"] == JobState.PLACED.value
    assert await kept(pool) == [] and projector.skipped == 1


async def test_events_about_unknown_jobs_are_capped_in_rows_newest_kept(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    """A producer writing lifecycle events about made-up job ids fills at most the cap: past
    it the oldest kept rows go (counted), and a job heard of later still gets what is kept."""
    pool, redis = rig
    projector = Projector(pool, redis, early_max=5, early_trim_every=4)
    for i in range(3):
        await projector.process((started(f"j-flood-{i}"),))  # type: ignore[arg-type]
    assert len(await kept(pool)) == 3  # under the trim's period: nothing looked at yet
    for i in range(3, 12):
        await projector.process((started(f"j-flood-{i}"),))  # type: ignore[arg-type]
    # Trimmed after every 4th row kept: never more than the cap plus the trim period less one.
    rows = await kept(pool)
    assert 5 <= len(rows) <= 5 + 3
    assert "j-flood-11" in rows and "j-flood-0" not in rows
    assert projector.early_dropped._value.get() == 12 - len(rows)
    # The newest kept event is still folded in when its job appears.
    await projector.process((queued("j-flood-11"),))  # type: ignore[arg-type]
    row = await view(pool, "j-flood-11")
    assert row is not None and row["state"] == JobState.RUNNING.value


async def test_events_about_unknown_jobs_are_capped_in_bytes_too(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    """A record may be up to a MiB: the rows' count alone does not bound what they hold."""
    pool, redis = rig
    projector = Projector(pool, redis, early_max=1000, early_max_bytes=1500, early_trim_every=1)
    for i in range(10):
        await projector.process((started(f"j-big-{i}"),))  # type: ignore[arg-type]
    size = await pool.fetchval("SELECT sum(octet_length(value)) FROM gateway.early_events")
    rows = await kept(pool)
    assert size <= 1500 and 1 <= len(rows) < 10
    assert "j-big-9" in rows and "j-big-0" not in rows
    assert projector.early_dropped._value.get() == 10 - len(rows)
