"""The gateway's read model on the real PostgreSQL: a job's spec is written once, with the view
that first holds it, and every later event about the job leaves it as it was without sending it
again or parsing it back: the projection reads only what it needs of it (the type a waiting job
asks for, the memory its first run asked for). An event read before its job is kept as it
came."""

from __future__ import annotations

import json
from dataclasses import replace

import asyncpg
import pytest
from redis.asyncio import Redis

from schemas import topics
from schemas.events import JobQueued
from schemas.job import JobSpec, JobState
from services.gateway import store
from services.gateway.handlers import Projector
from services.gateway.projection import JobView, Placement, ReplicaPlacement
from tests.integration import test_gateway_early_events as early
from tests.integration.test_gateway_early_events import T0, placed, queued, rec, spec, started
from tests.unit.gateway.builders import record

pytestmark = pytest.mark.integration

rig = early.rig  # the fixture: the gateway's stores, migrated
SPEC_COLUMN = 15  # the position of the spec's JSON in store._row


async def locked(pool: asyncpg.Pool, job_id: str) -> JobView:
    async with pool.acquire() as conn, conn.transaction():
        return (await store.lock_views(conn, [job_id]))[job_id]


async def test_a_stored_spec_is_never_parsed_nor_sent_again(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    pool, redis = rig
    projector = Projector(pool, redis)
    job = "j-spec"
    first = queued(job)
    want = spec(job)

    await projector.process((first,))  # type: ignore[arg-type]
    view = await locked(pool, job)
    assert view.state == JobState.QUEUED
    # What the projection needs of the spec comes with the row; the spec is not parsed.
    assert view.spec is None and view.spec_stored
    assert (view.wanted, view.first_memory_gb) == ("any", want.resources.memory_gb)
    assert view.accelerator_type == "any"  # the job asks for any type
    # The spec column of the upsert is empty for a view whose spec came from its row...
    assert store._row(view)[SPEC_COLUMN] is None
    # ... and holds the spec for a view that is not stored yet.
    fresh = JobView(job, "vision", JobState.SUBMITTED, T0, T0, spec=want)
    assert store._row(fresh)[SPEC_COLUMN] == want.model_dump_json(exclude_none=True)

    for batch in ((placed(job),), (started(job),)):
        await projector.process(batch)  # type: ignore[arg-type]
    view = await locked(pool, job)
    assert (view.state, view.attempt, view.cluster) == (JobState.RUNNING, 1, "c1")
    assert view.spec is None and view.spec_stored and view.wanted == "any"
    assert view.accelerator_type == "H100"  # the type it holds
    row = await pool.fetchrow(
        "SELECT spec, project, accelerators FROM gateway.jobs WHERE job_id = $1", job
    )
    assert row is not None and JobSpec.model_validate_json(row["spec"]) == want
    assert (row["project"], row["accelerators"]) == (want.project, want.total_accelerators)


async def test_a_view_without_a_spec_gets_the_first_one_it_hears(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    """A view written before its spec was known (here by hand) is not `spec_stored`: the spec
    of its job.queued is sent and kept."""
    pool, redis = rig
    job = "j-late-spec"
    async with pool.acquire() as conn, conn.transaction():
        await store.upsert_views(conn, [JobView(job, "vision", JobState.SUBMITTED, T0, T0)])
    bare = await locked(pool, job)
    assert bare.spec is None and not bare.spec_stored

    await Projector(pool, redis).process((queued(job),))  # type: ignore[arg-type]
    view = await locked(pool, job)
    assert view.spec_stored and view.wanted == "any"
    stored = await pool.fetchval("SELECT spec FROM gateway.jobs WHERE job_id = $1", job)
    assert JobSpec.model_validate_json(stored) == spec(job)


async def test_a_row_from_before_the_wanted_type_column_reads_its_spec_and_gets_the_column(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    """A row written before migration 012 has a spec and no `wanted_type`: its spec is parsed
    as before, and the job's next event fills the column."""
    pool, redis = rig
    job = "j-old-row"
    want = JobSpec.model_validate(
        {
            "job_id": job,
            "tenant": "nlp",
            "resources": {"accelerators": 1, "accelerator_types": ["H100", "A100"]},
        }
    )
    async with pool.acquire() as conn, conn.transaction():
        await store.upsert_views(conn, [JobView(job, "nlp", JobState.QUEUED, T0, T0, spec=want)])
    await pool.execute("UPDATE gateway.jobs SET wanted_type = NULL WHERE job_id = $1", job)
    old = await locked(pool, job)
    assert old.spec == want and old.spec_stored and old.accelerator_type == "A100|H100"

    await Projector(pool, redis).process((started(job),))  # type: ignore[arg-type]
    assert (
        await pool.fetchval("SELECT wanted_type FROM gateway.jobs WHERE job_id = $1", job)
        == "A100|H100"
    )
    again = await locked(pool, job)
    assert again.spec is None and again.wanted == "A100|H100"


async def test_a_requeue_with_more_memory_says_so_for_a_stored_view(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    """The memory a retry grows to is told against the first run's, read from the stored row
    (not from the spec, which is not read back)."""
    pool, redis = rig
    job = "j-grown"
    projector = Projector(pool, redis)
    for batch in ((queued(job),), (placed(job),), (started(job),)):
        await projector.process(batch)  # type: ignore[arg-type]
    grown = spec(job).model_copy(
        update={"resources": spec(job).resources.model_copy(update={"memory_gb": 48.0})}
    )
    retry = JobQueued(job_id=job, spec=grown, submitted_at=T0, attempt=1, requeue_of_attempt=1)
    await projector.process((rec(topics.JOB_QUEUED, retry, 20, job),))  # type: ignore[arg-type]
    message = await pool.fetchval(
        "SELECT message FROM gateway.job_events WHERE job_id = $1 AND type = 'JobQueued'"
        " ORDER BY at DESC LIMIT 1",
        job,
    )
    assert message == "requeued after attempt 1, with 48 GB memory per replica"
    view = await locked(pool, job)
    assert view.state == JobState.QUEUED and view.first_memory_gb == spec(job).resources.memory_gb


async def test_an_early_event_is_kept_as_it_came(rig: tuple[asyncpg.Pool, Redis]) -> None:
    """A placement read before its job is kept byte for byte, a field this version does not
    know included (a newer gateway taking it back may know it), and folded in later."""
    pool, redis = rig
    job = "j-early"
    decided = json.loads(placed(job).value)  # type: ignore[attr-defined]
    decided["payload"]["from_a_newer_producer"] = {"kept": True}
    value = json.dumps(decided).encode()
    projector = Projector(pool, redis)

    await projector.process((record(topics.PLACEMENT_DECIDED, value, 900, job),))
    rows = await pool.fetch("SELECT value FROM gateway.early_events WHERE job_id = $1", job)
    assert [bytes(r["value"]) for r in rows] == [value]

    await projector.process((queued(job),))  # type: ignore[arg-type]
    view = await locked(pool, job)
    assert (view.state, view.cluster) == (JobState.PLACED, "c1")
    assert await pool.fetchval("SELECT count(*) FROM gateway.early_events") == 0


async def test_views_upserted_in_one_statement_read_back_as_they_were(
    rig: tuple[asyncpg.Pool, Redis],
) -> None:
    """A batch of views of every shape, inserted and then updated in one statement each, reads
    back as written: no spec and a spec, no nodes and several (a comma in one's name), a
    placement, an ended attempt. The batch comes unsorted; the statement locks in id order."""
    pool, _ = rig
    placement = Placement(
        2,
        "c1",
        "h100",
        (
            ReplicaPlacement(0, "n,1", 8.0, (0, 1)),
            ReplicaPlacement(1, "n2", 8.0, ()),
        ),
    )
    first = [
        JobView("j-batch-b", "vision", JobState.SUBMITTED, T0, T0),
        JobView("j-batch-a", "nlp", JobState.QUEUED, T0, T0, spec=rich_spec("j-batch-a")),
        JobView("j-batch-c", "vision", JobState.QUEUED, T0, T0, spec=spec("j-batch-c")),
    ]
    later = T0.replace(minute=5)
    second = [
        replace(
            first[2],
            state=JobState.SUCCEEDED,
            attempt=2,
            ended_attempt=2,
            updated_at=later,
            cluster="c1",
            nodes=("n,1", "n2"),
            placement=placement,
            reason_code="done",
            message="exit 0",
        ),
        replace(first[0], state=JobState.CANCELED, updated_at=later, message="by alice"),
        replace(first[1], state=JobState.PLACED, attempt=1, cluster="c2", nodes=("m1",)),
    ]
    for batch in (first, second):
        async with pool.acquire() as conn, conn.transaction():
            await store.upsert_views(conn, batch)
        async with pool.acquire() as conn, conn.transaction():
            got = await store.lock_views(conn, [v.job_id for v in batch])
        # A stored spec is not read back; what the projection needs of it is.
        assert got == {v.job_id: replace(v, spec=None) for v in batch}
        assert {j: (g.spec_stored, g.wanted, g.first_memory_gb) for j, g in got.items()} == {
            v.job_id: (
                v.spec is not None,
                v.asked_type,
                v.spec.resources.memory_gb if v.spec else None,
            )
            for v in batch
        }
        # The columns the view is not read back from: each from its own field of the spec.
        rows = await pool.fetch(
            'SELECT job_id, project, "user", queue, name, replicas, accelerators,'
            " idempotency_key, accelerator_type FROM gateway.jobs WHERE job_id = ANY($1::text[])",
            [v.job_id for v in batch],
        )
        assert {r["job_id"]: tuple(r)[1:] for r in rows} == {
            v.job_id: (
                *(
                    (s.project, s.user, s.queue, s.name, s.replicas, s.total_accelerators)
                    if (s := v.spec)
                    else (None,) * 6
                ),
                s.idempotency_key if s else None,
                v.accelerator_type,
            )
            for v in batch
        }


def rich_spec(job_id: str) -> JobSpec:
    """Every field the view keeps a column of, each telling itself apart from the others."""
    return JobSpec.model_validate(
        {
            "job_id": job_id,
            "tenant": "nlp",
            "project": "proj",
            "user": "alice",
            "queue": "batch",
            "name": "sweep-7",
            "idempotency_key": "key-1",
            "replicas": 2,
            "resources": {"accelerators": 3, "accelerator_type": "H100"},
        }
    )
