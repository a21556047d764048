"""PostgreSQL's statistics on a table, read at once (the session's counts flushed first), and
the rows a table's first page holds once it is filled."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

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


async def fill_then_first_page(
    conn: asyncpg.Connection,
    table: str,
    job_ids: Sequence[str],
    write: Callable[[asyncpg.Connection, list[str]], Awaitable[object]],
) -> list[str]:
    """Write rows for `job_ids` with `write`, twenty at a time, each batch its own transaction
    (as consumed); then the job ids on `table`'s first page, filled as far as it is filled."""
    for i in range(0, len(job_ids), 20):
        async with conn.transaction():
            await write(conn, list(job_ids[i : i + 20]))
    rows = await conn.fetch(
        f"SELECT job_id FROM {table} WHERE (ctid::text::point)[0] = 0 ORDER BY job_id"
    )
    return [r["job_id"] for r in rows]
