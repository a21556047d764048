"""The dashboard's reads on real PostgreSQL: keyset pages that cover every job once in both
directions (ties in submission time included), filters and groups done in SQL, the CSV walk,
and the overview's figures."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from services.gateway.dashboard import queries
from services.gateway.dashboard.queries import JobQuery
from services.gateway.store import migrate_gateway

pytestmark = pytest.mark.integration

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
STATES = ["queued", "running", "succeeded", "failed", "canceled"]


@pytest.fixture
async def pool(fresh_database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await asyncpg.create_pool(fresh_database_url, min_size=1, max_size=4)
    assert pool is not None
    await migrate_gateway(pool)
    yield pool
    await pool.close()


async def fill(pool: asyncpg.Pool, n: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        jobs.append(
            {
                "job_id": f"job-{i:04d}-{rng.randrange(10**6):06d}",
                "tenant": rng.choice(["vision", "nlp"]),
                "queue": rng.choice(["default", "batch"]),
                "state": rng.choice(STATES),
                # many jobs share a submission instant: the cursor must still move on
                "submitted_at": T0 + timedelta(seconds=rng.randrange(n // 3)),
            }
        )
    await pool.executemany(
        "INSERT INTO gateway.jobs (job_id, tenant, queue, state, submitted_at, updated_at,"
        " accelerators, accelerator_type) VALUES ($1, $2, $3, $4, $5, $5, 1, 'H100')",
        [(j["job_id"], j["tenant"], j["queue"], j["state"], j["submitted_at"]) for j in jobs],
    )
    return jobs


async def walk(pool: asyncpg.Pool, q: JobQuery) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        page = await queries.jobs_page(pool, JobQuery(q.filters, None, q.sort, q.limit, cursor), T0)
        pages.append([r["job_id"] for r in page.rows])
        if page.next_cursor is None:
            return pages
        cursor = page.next_cursor


@pytest.mark.parametrize("sort", ["newest", "oldest"])
async def test_pages_cover_every_matching_job_once_in_order(pool: asyncpg.Pool, sort: str) -> None:
    jobs = await fill(pool, 137)
    q = JobQuery({"tenant": ("vision",)}, sort=sort, limit=25)
    pages = await walk(pool, q)
    seen = [j for p in pages for j in p]
    expected = sorted(
        (j for j in jobs if j["tenant"] == "vision"),
        key=lambda j: (j["submitted_at"], j["job_id"]),
        reverse=sort == "newest",
    )
    assert seen == [j["job_id"] for j in expected]
    assert all(len(p) == 25 for p in pages[:-1]) and 0 < len(pages[-1]) <= 25

    # Going back from the second page gives the first, exactly.
    first = await queries.jobs_page(pool, JobQuery(q.filters, None, sort, 25), T0)
    second = await queries.jobs_page(
        pool, JobQuery(q.filters, None, sort, 25, after=first.next_cursor), T0
    )
    assert [r["job_id"] for r in second.rows] == pages[1]
    back = await queries.jobs_page(
        pool, JobQuery(q.filters, None, sort, 25, before=second.prev_cursor), T0
    )
    assert [r["job_id"] for r in back.rows] == pages[0]
    assert back.prev_cursor is None  # the first page has nothing before it


async def test_filters_groups_and_the_csv_walk_agree(pool: asyncpg.Pool) -> None:
    jobs = await fill(pool, 240, seed=11)
    q = JobQuery.parse({"state": "pending,running", "queue": "batch"}, scope_tenant=None)
    expected = {
        j["job_id"] for j in jobs if j["state"] in ("queued", "running") and j["queue"] == "batch"
    }
    assert {j for p in await walk(pool, q) for j in p} == expected
    assert {r["job_id"] async for r in queries.csv_rows(pool, q)} == expected

    grouped = JobQuery.parse({"group": "tenant"}, scope_tenant=None)
    rows = {r["key"]: r for r in await queries.groups(pool, grouped)}
    for tenant in ("vision", "nlp"):
        mine = [j for j in jobs if j["tenant"] == tenant]
        assert rows[tenant]["jobs"] == len(mine)
        assert rows[tenant]["pending"] == sum(j["state"] == "queued" for j in mine)
        assert rows[tenant]["holding"] == sum(j["state"] == "running" for j in mine)
        assert float(rows[tenant]["allocated"]) == rows[tenant]["holding"]

    some = [j["job_id"] for j in jobs[:50]]
    found = await queries.rows_by_id(pool, q, some)
    assert {r["job_id"] for r in found} == expected & set(some)

    by_state = await queries.jobs_by_state(pool, "nlp")
    assert sum(by_state.values()) == sum(j["tenant"] == "nlp" for j in jobs)
    oldest = await queries.oldest_pending(pool, None)
    queued = [j for j in jobs if j["state"] == "queued"]
    assert oldest is not None
    assert oldest["submitted_at"] == min(j["submitted_at"] for j in queued)


async def test_queue_wait_and_position(pool: asyncpg.Pool) -> None:
    await pool.executemany(
        "INSERT INTO gateway.jobs (job_id, tenant, state, submitted_at, updated_at)"
        " VALUES ($1, $2, $3, $4, $4)",
        [
            ("a", "vision", "running", T0),
            ("b", "vision", "running", T0 + timedelta(seconds=10)),
            ("c", "nlp", "queued", T0 + timedelta(seconds=20)),
            ("d", "vision", "queued", T0 + timedelta(seconds=30)),
        ],
    )
    await pool.executemany(
        "INSERT INTO gateway.job_events (event_id, job_id, at, type) VALUES ($1, $2, $3, $4)",
        [
            ("e1", "a", T0 + timedelta(seconds=4), "JobStarted"),
            ("e2", "a", T0 + timedelta(seconds=100), "JobStarted"),  # a restart: not a wait
            ("e3", "b", T0 + timedelta(seconds=30), "JobStarted"),
        ],
    )
    wait = await queries.queue_wait(pool, None, T0 - timedelta(days=1))
    assert wait["n"] == 2 and wait["p50"] == pytest.approx(12.0)
    assert (await queries.queue_wait(pool, "nlp", T0 - timedelta(days=1)))["n"] == 0
    # A window holds the waits of jobs that first started in it: a's restart at 100 s is not
    # one (its first start, at 4 s, is before the window), b's start at 30 s is.
    late = await queries.queue_wait(pool, None, T0 + timedelta(seconds=20))
    assert late["n"] == 1 and late["p50"] == pytest.approx(20.0)
    assert (await queries.queue_wait(pool, None, T0 + timedelta(seconds=50)))["n"] == 0
    d = await pool.fetchrow("SELECT * FROM gateway.jobs WHERE job_id = 'd'")
    assert await queries.pending_position(pool, d) == {"tenant": 1, "all": 2}


async def test_a_line_about_another_tenants_job_does_not_name_it(pool: asyncpg.Pool) -> None:
    from services.gateway.store import OTHER_JOB, history

    await pool.executemany(
        "INSERT INTO gateway.jobs (job_id, tenant, state, submitted_at, updated_at)"
        " VALUES ($1, $2, 'running', $3, $3)",
        [("victim", "vision", T0), ("claimant", "nlp", T0), ("own", "vision", T0)],
    )
    await pool.executemany(
        "INSERT INTO gateway.job_events (event_id, job_id, at, type, message, for_job)"
        " VALUES ($1, 'victim', $2, 'JobCheckpointRequested', $3, $4)",
        [
            ("e1", T0, "asked to checkpoint to make room for job claimant (quota)", "claimant"),
            ("e2", T0 + timedelta(seconds=1), "to make room for job own (fair)", "own"),
            ("e3", T0 + timedelta(seconds=2), "to make room for job gone (x)", "gone"),
        ],
    )
    as_vision = await history(pool, "victim", lambda tenant: tenant == "vision")
    assert [ln["message"] for ln in as_vision] == [
        f"asked to checkpoint to make room for {OTHER_JOB} (quota)",
        "to make room for job own (fair)",  # its own tenant's job: named
        f"to make room for {OTHER_JOB} (x)",  # unknown to the read model: not named
    ]
    assert [ln["for_job"] for ln in as_vision] == [None, "own", None]
    as_admin = await history(pool, "victim", lambda tenant: True)
    assert as_admin[0]["message"].endswith("job claimant (quota)")
