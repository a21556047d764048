"""The gateway's read model on the real PostgreSQL: a job's spec is written once, with the view
that first holds it, and every later event about the job leaves it as it was without sending it
again (the projection reads it back for what it needs: the type a waiting job asks for). An
event read before its job is kept as it came."""

from __future__ import annotations

import json
from dataclasses import replace

import asyncpg
import pytest
from redis.asyncio import Redis

from schemas import topics
from schemas.job import JobSpec, JobState
from services.gateway import store
from services.gateway.handlers import Projector
from services.gateway.projection import JobView, Placement, ReplicaPlacement
from tests.integration import test_gateway_early_events as early
from tests.integration.test_gateway_early_events import T0, placed, queued, spec, started
from tests.unit.gateway.builders import record

pytestmark = pytest.mark.integration

rig = early.rig  # the fixture: the gateway's stores, migrated
SPEC_COLUMN = 15  # the position of the spec's JSON in store._row


async def locked(pool: asyncpg.Pool, job_id: str) -> JobView:
    async with pool.acquire() as conn, conn.transaction():
        return (await store.lock_views(conn, [job_id]))[job_id]


async def test_a_stored_spec_is_read_back_whole_and_never_sent_again(
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
    assert view.spec == want and view.spec_stored
    assert view.accelerator_type == "any"  # from the spec read back: the job asks for any type
    # The spec column of the upsert is empty for a view whose spec came from its row...
    assert store._row(view)[SPEC_COLUMN] is None
    # ... and holds the spec for a view that is not stored yet.
    fresh = JobView(job, "vision", JobState.SUBMITTED, T0, T0, spec=want)
    assert store._row(fresh)[SPEC_COLUMN] == want.model_dump_json(exclude_none=True)

    for batch in ((placed(job),), (started(job),)):
        await projector.process(batch)  # type: ignore[arg-type]
    view = await locked(pool, job)
    assert (view.state, view.attempt, view.cluster) == (JobState.RUNNING, 1, "c1")
    assert view.spec == want and view.spec_stored
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
    assert view.spec is not None and view.spec.job_id == job and view.spec_stored


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
        assert got == {v.job_id: v for v in batch}
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
