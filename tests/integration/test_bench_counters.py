"""The e2e bench reads PostgreSQL's own counters (bench/counters.py): row writes, HOT updates and
WAL, from a real server. A renamed column or view would otherwise leave the bench's figures
quietly empty."""

from __future__ import annotations

import asyncpg
import pytest

from bench.counters import StackCounters, per_job

ROWS = 200


async def flushed(conn: asyncpg.Connection) -> None:
    """This session's statistics sent now, not within the next second or ten."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT 1")


async def test_row_writes_hot_updates_and_wal_per_job(fresh_database_url: str) -> None:
    conn = await asyncpg.connect(fresh_database_url)
    try:
        if not await conn.fetchval(
            "SELECT count(*) FROM pg_proc WHERE proname = 'pg_stat_force_next_flush'"
        ):
            pytest.skip("PostgreSQL before 15: its statistics cannot be flushed on demand")
        # Room on every page, no index on what changes: the updates can all be HOT.
        await conn.execute(
            "CREATE TABLE probe (id int PRIMARY KEY, n int NOT NULL) WITH (fillfactor = 50)"
        )
        await flushed(conn)
        counters = StackCounters(fresh_database_url, {})
        before = await counters.read()

        await conn.execute("INSERT INTO probe SELECT g, 0 FROM generate_series(1, $1) g", ROWS)
        await conn.execute("UPDATE probe SET n = n + 1")
        await flushed(conn)
        after = await counters.read()
    finally:
        await conn.close()

    counts = per_job(before, after, ROWS, 1.0)
    pg = counts["pg"]
    assert isinstance(pg, dict)
    # Other databases' work on a shared server can only add to the WAL's figures.
    assert pg["tup_inserted"] >= 1.0
    assert pg["tup_updated"] >= 1.0
    assert pg["tup_hot_updated"] >= 1.0
    # Each row: a heap insert, its key in the primary key's index, and its update.
    assert pg["wal_records"] >= 3.0
    assert pg["wal_bytes"] > 0
    assert counts["tables"] == {"public.probe": 2.0}
