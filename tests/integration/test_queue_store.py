"""The queue's job rows on real PostgreSQL: what serializes two writers of one job.

The queue reads a job's row, decides, and writes it back. Two replicas (or its two consumer
groups) may do that for the same job at once. The per-job advisory locks of `serialize_jobs`
are what keeps the second from deciding on a row the first is about to change: its read waits
for the first transaction to end, then sees what it wrote. The rows are read without a row
lock, so nothing else would stop a lost update.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime

import asyncpg

from services.common.db import create_pool, migrate
from services.queue import store

AT = datetime(2026, 11, 28, 12, tzinfo=UTC)


async def bump_attempt(conn: asyncpg.Connection, job_id: str) -> int:
    """One read-decide-write of the row, as the queue's batch step does it: the attempt it read."""
    await store.serialize_jobs(conn, [job_id])
    record = (await store.read_jobs(conn, [job_id]))[job_id]
    await store.update_jobs(conn, [dataclasses.replace(record, attempt=record.attempt + 1)])
    return record.attempt


async def waiting_on_a_lock(pool: asyncpg.Pool, pid: int) -> None:
    """Until the backend `pid` waits on a heavyweight lock (an advisory one here)."""
    while (
        await pool.fetchval("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1", pid)
        != "Lock"
    ):
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
