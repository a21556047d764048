"""The preemptor's timer queries on real PostgreSQL: a run whose end is already in the job facts
(it ended while the timer was ordering its stop) is settled, not alerted on; an unanswered
order is claimed for one alert, once; the timer's look without a transaction finds a row
exactly when its claim would take one."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import asyncpg

from services.common.db import create_pool, migrate
from services.preemptor import store
from services.preemptor.guards import JobFacts
from tests.integration.pg_stats import fill_then_first_page, updates_of

NOW = datetime(2026, 11, 22, 12, tzinfo=UTC)


async def test_ended_runs_are_settled_and_the_rest_alerted_once(fresh_database_url: str) -> None:
    pool = await create_pool(fresh_database_url)
    try:
        await migrate(pool, store.SCHEMA, store.MIGRATIONS)
        async with pool.acquire() as conn:
            await ordered(conn, "ended", ordered_ago_s=120)
            await ordered(conn, "silent", ordered_ago_s=120)
            await ordered(conn, "recent", ordered_ago_s=5)
            await conn.execute(
                "INSERT INTO preemptor.jobs (job_id, started_attempt, ended_attempt) "
                "VALUES ('ended', 1, 1), ('silent', 1, NULL), ('recent', 1, NULL)"
            )
            async with conn.transaction():
                settled = await store.settle_ended(conn, NOW)
                late = await store.claim_unanswered(conn, NOW - timedelta(seconds=60), NOW, 10)
            async with conn.transaction():
                again = await store.claim_unanswered(conn, NOW - timedelta(seconds=60), NOW, 10)
            states = dict(await conn.fetch("SELECT job_id, state FROM preemptor.preemptions"))
    finally:
        await pool.close()
    assert [(req.job_id, how) for req, how in settled] == [("ended", "facts")]
    assert [req.job_id for req, _ in late] == ["silent"]
    assert again == []
    assert states == {"ended": "done", "silent": "ordered", "recent": "ordered"}


async def test_the_timers_look_finds_what_its_claim_would_take(fresh_database_url: str) -> None:
    pool = await create_pool(fresh_database_url)
    seen: list[tuple[str, bool, list[str]]] = []
    try:
        await migrate(pool, store.SCHEMA, store.MIGRATIONS)

        async def look(case: str) -> None:
            async with pool.acquire() as conn, conn.transaction():
                # Claiming only locks the rows; nothing changes when it commits.
                claimed = [t.request.job_id for t in await store.claim_due(conn, NOW, 10)]
            seen.append((case, await store.anything_due(pool, NOW), claimed))

        await look("empty")
        async with pool.acquire() as conn:
            await ordered(conn, "ordered", ordered_ago_s=120)
            await ordered(conn, "later", ordered_ago_s=120, state="signaled", stop_in_s=30)
        await look("an order out and a stop not due yet")
        async with pool.acquire() as conn:
            await ordered(conn, "due", ordered_ago_s=120, state="signaled", stop_in_s=-1)
        await look("a stop due")
        async with pool.acquire() as conn:
            await conn.execute(
                "UPDATE preemptor.preemptions SET state = 'done' WHERE job_id = 'due'"
            )
            await ordered(conn, "held", ordered_ago_s=120, state="held")
        await look("a held request")
    finally:
        await pool.close()
    assert seen == [
        ("empty", False, []),
        ("an order out and a stop not due yet", False, []),
        ("a stop due", True, ["due"]),
        ("a held request", True, ["held"]),
    ]


async def ordered(
    conn: asyncpg.Connection,
    victim: str,
    ordered_ago_s: float,
    *,
    state: str = "ordered",
    stop_in_s: float | None = None,
) -> None:
    request = {
        "job_id": victim,
        "attempt": 1,
        "cluster": "c1",
        "tenant": "t",
        "priority_class": "low",
        "claim": {"rank": 0, "guaranteed": False, "level": 0},
        "for_job": "f",
        "for_tenant": "t",
        "for_priority_class": "high",
        "for_claim": {"rank": 50, "guaranteed": True, "level": 0},
        "reason_code": "preempted_for_priority",
        "message": "m",
        "grace_s": 60,
        "epoch": 1,
        "leader": "s",
    }
    at = NOW - timedelta(seconds=ordered_ago_s)
    stop_at = None if stop_in_s is None else NOW + timedelta(seconds=stop_in_s)
    await conn.execute(
        "INSERT INTO preemptor.preemptions (id, job_id, attempt, cluster, tenant, for_job, "
        "for_tenant, reason_code, epoch, request, trace_id, requested_at, received_at, state, "
        "ordered_at, stop_at) VALUES ($1, $2, 1, 'c1', 't', 'f', 't', "
        "'preempted_for_priority', 1, $3::jsonb, 'tr', $4, $4, $5, $6, $7)",
        f"p-{victim}",
        victim,
        json.dumps(request),
        at,
        state,
        at if state == "ordered" else None,
        stop_at,
    )


async def test_a_jobs_facts_are_updated_in_place(fresh_database_url: str) -> None:
    """The facts of a job are written as it is placed and again as it starts and ends. With
    room left on each page (004_fillfactor.sql) an update can stay on its page and write no
    index entry (HOT); on a full page it cannot. The updates here fit in the room a page
    keeps, so whether they are HOT does not depend on what else the server is doing (pruning
    old row versions, which any older open transaction on the server holds back)."""
    pool = await create_pool(fresh_database_url)
    jobs = [f"job-{i:04d}" for i in range(600)]
    try:
        await migrate(pool, store.SCHEMA, store.MIGRATIONS)
        async with pool.acquire() as conn:
            first_page = await fill_then_first_page(
                conn,
                "preemptor.jobs",
                jobs,
                lambda c, batch: store.save_facts(c, [JobFacts(j, placed_at=NOW) for j in batch]),
            )
            assert len(first_page) > 10  # the page was filled as far as it is filled
            before = await updates_of(conn, "preemptor", "jobs")
            started = [JobFacts(j, started_attempt=1, started_at=NOW) for j in first_page[:10]]
            async with conn.transaction():
                await store.save_facts(conn, started)
            after = await updates_of(conn, "preemptor", "jobs")
    finally:
        await pool.close()
    assert (after[0] - before[0], after[1] - before[1]) == (10, 10)  # (updates, HOT)
