"""The queue's job rows on real PostgreSQL: what serializes two writers of one job, and
state changes that stay on their page.

The queue reads a job's row, decides, and writes it back. Two replicas (or its two consumer
groups) may do that for the same job at once. The per-job advisory locks `lock_jobs` takes
before it reads are what keeps the second from deciding on a row the first is about to
change: its read waits for the first transaction to end, then sees what it wrote. The rows
are read without a row lock, so nothing else would stop a lost update.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime

import asyncpg

from schemas.job import JobSpec, JobState
from services.common.db import create_pool, migrate
from services.queue import store
from services.queue.lifecycle import JobRecord
from tests.integration.pg_stats import fill_then_first_page, updates_of

AT = datetime(2026, 11, 28, 12, tzinfo=UTC)


async def bump_attempt(conn: asyncpg.Connection, job_id: str) -> int:
    """One read-decide-write of the row, as the queue's batch step does it: the attempt it read."""
    record = (await store.lock_jobs(conn, [job_id]))[job_id]
    await store.update_jobs(conn, [dataclasses.replace(record, attempt=record.attempt + 1)])
    return record.attempt


async def waiting_on_a_lock(pool: asyncpg.Pool, pid: int) -> None:
    """Until the backend `pid` waits on a heavyweight lock (an advisory one here)."""
    query = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1"
    while True:
        if await pool.fetchval(query, pid) == "Lock":
            return
        await asyncio.sleep(0.01)


async def test_a_second_writer_waits_for_the_first_and_decides_on_what_it_wrote(
    fresh_database_url: str,
) -> None:
    pool = await create_pool(fresh_database_url)
    try:
        await migrate(pool, store.SCHEMA, store.MIGRATIONS)
        await pool.execute(
            "INSERT INTO queue.jobs (job_id, tenant, state, spec, submitted_at, updated_at) "
            "VALUES ('j1', 'vision', 'running', '{}', $1, $1)",
            AT,
        )
        async with pool.acquire() as first, pool.acquire() as second:
            second_pid = second.get_server_pid()
            async with first.transaction():
                first_read = await bump_attempt(first, "j1")

                async def second_writer() -> int:
                    async with second.transaction():
                        return await bump_attempt(second, "j1")

                second_task = asyncio.create_task(second_writer())
                # Asserted on what happened, not on time: the second is blocked on the lock
                # while the first has not committed (a broken lock would let it finish).
                await asyncio.wait_for(waiting_on_a_lock(pool, second_pid), timeout=60)
                assert not second_task.done()
            second_read = await asyncio.wait_for(second_task, timeout=60)
        final = await pool.fetchval("SELECT attempt FROM queue.jobs WHERE job_id = 'j1'")
    finally:
        await pool.close()
    assert (first_read, second_read, final) == (0, 1, 2)  # no update lost


def queued(job_id: str) -> tuple[JobRecord, JobSpec]:
    spec = JobSpec(
        tenant="vision",
        job_id=job_id,
        name="resnet50-sweep",
        command=["python", "-m", "train", "--epochs", "90", "--lr", "0.1"],
        resources={"accelerators": 8, "accelerator_type": "h100"},
        labels={"team": "perception", "experiment": "sweep-17"},
    )
    return JobRecord(job_id, "vision", JobState.QUEUED, AT, AT), spec


async def test_a_jobs_state_changes_stay_on_its_page(fresh_database_url: str) -> None:
    """Each state change of a job updates its row. With no index on the state and room kept on
    each page (008_hot_updates.sql), the new version goes on the same page and no index entry
    is written (HOT); with either missing, none is. A row is wide (its spec rides in it: about
    750 bytes in the e2e bench), so a page's room holds three new versions before pruning
    must make more; two updates fit, so this does not depend on pruning, which an older open
    transaction on the server holds back."""
    pool = await create_pool(fresh_database_url)
    jobs = [f"job-{i:04d}" for i in range(300)]
    try:
        await migrate(pool, store.SCHEMA, store.MIGRATIONS)
        async with pool.acquire() as conn:
            first_page = await fill_then_first_page(
                conn,
                "queue.jobs",
                jobs,
                lambda c, batch: store.insert_jobs(c, [queued(j) for j in batch]),
            )
            assert len(first_page) > 2  # the page was filled as far as it is filled
            before = await updates_of(conn, "queue", "jobs")
            async with conn.transaction():
                records = await store.lock_jobs(conn, first_page[:2])
                await store.update_jobs(
                    conn,
                    [
                        dataclasses.replace(r, state=JobState.PLACED, cluster="onprem-h100")
                        for r in records.values()
                    ],
                )
            after = await updates_of(conn, "queue", "jobs")
    finally:
        await pool.close()
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)  # (updates, HOT)
