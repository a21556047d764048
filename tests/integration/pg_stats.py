"""PostgreSQL's statistics on a table, read at once (the session's counts flushed first)."""

from __future__ import annotations

import asyncpg
import pytest


async def updates_of(conn: asyncpg.Connection, schema: str, table: str) -> tuple[int, int]:
    """(updates, HOT updates) of `schema.table` so far, this session's counts included.
    Skips before PostgreSQL 15, whose statistics cannot be flushed on demand."""
    if not await conn.fetchval(
        "SELECT count(*) FROM pg_proc WHERE proname = 'pg_stat_force_next_flush'"
    ):
        pytest.skip("PostgreSQL before 15: its statistics cannot be flushed on demand")
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT 1")
    row = await conn.fetchrow(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
        "WHERE schemaname = $1 AND relname = $2",
        schema,
        table,
    )
    assert row is not None
    return row["n_tup_upd"], row["n_tup_hot_upd"]
