"""Every service's statements are planned for the table as it is when they run. With cached
generic plans, a statement first run on an empty table (a new database: the dev stack's start,
a new deployment) kept the sequential scan it was planned with as the table grew, and where
autovacuum is off nothing ever replanned it: over one 12,000-job e2e bench the queue's lookups
and updates by job id read 3.2 million rows, the meter's 0.8 million, the gateway's 0.75
million (`pg_stat_user_tables.seq_tup_read`), a cost that grows with every job ever run."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from services.common.db import create_pool, migrate

# How the services look rows up by a batch of keys (services/queue/store.py and others).
LOOKUP = "SELECT p.id FROM plan_probe AS p JOIN unnest($1::text[]) AS u(id) ON p.id = u.id"
BATCH = [f"a{i}" for i in range(50)]


async def plans_after_the_table_grew(pool: asyncpg.Pool) -> tuple[int, int]:
    """(generic, custom) plans of one cached statement run on an empty table, then on a full
    one, on one connection of `pool`."""
    async with pool.acquire() as conn:
        await conn.execute("CREATE TABLE plan_probe (id text PRIMARY KEY)")
        for _ in range(8):  # past the five custom plans after which one may go generic
            await conn.fetch(LOOKUP, BATCH)
        await conn.execute("INSERT INTO plan_probe SELECT 'k' || g FROM generate_series(1, 5000) g")
        assert [r["id"] for r in await conn.fetch(LOOKUP, ["k7", *BATCH])] == ["k7"]
        row = await conn.fetchrow(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
            LOOKUP,
        )
        await conn.execute("DROP TABLE plan_probe")
    assert row is not None
    return row["generic_plans"], row["custom_plans"]


async def test_a_service_pool_plans_every_statement_for_the_table_as_it_is(
    fresh_database_url: str,
) -> None:
    pool = await create_pool(fresh_database_url)
    try:
        generic, custom = await plans_after_the_table_grew(pool)
    finally:
        await pool.close()
    assert generic == 0 and custom == 9


async def test_a_default_pool_would_have_kept_a_plan_made_for_the_empty_table(
    fresh_database_url: str,
) -> None:
    """What the setting prevents, on this server: the same statements on a pool with
    PostgreSQL's default plan cache go generic once they have run a few times."""
    pool = await asyncpg.create_pool(fresh_database_url, min_size=1, max_size=1)
    assert pool is not None
    try:
        generic, _custom = await plans_after_the_table_grew(pool)
    finally:
        await pool.close()
    assert generic > 0


async def last_statement_of(pool: asyncpg.Pool, watcher: asyncpg.Connection) -> str:
    """What the pool's one connection last sent PostgreSQL, after it went back to the pool."""
    async with pool.acquire() as conn:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        await conn.execute("SELECT 'the last statement of the batch'")
    query = await watcher.fetchval("SELECT query FROM pg_stat_activity WHERE pid = $1", pid)
    assert isinstance(query, str)
    return query


async def test_a_service_pool_hands_a_connection_back_without_a_reset_round_trip(
    fresh_database_url: str,
) -> None:
    """asyncpg's default reset is one more statement per release; the service pools keep no
    session state, so they skip it (services/common/db.py, keep_session)."""
    watcher = await asyncpg.connect(fresh_database_url)
    plain = await asyncpg.create_pool(fresh_database_url, min_size=1, max_size=1)
    service = await create_pool(fresh_database_url, size=1)
    assert plain is not None
    try:
        assert "RESET ALL" in await last_statement_of(plain, watcher)
        assert await last_statement_of(service, watcher) == (
            "SELECT 'the last statement of the batch'"
        )
    finally:
        await plain.close()
        await service.close()
        await watcher.close()


async def test_a_transaction_left_open_is_rolled_back_before_the_next_batch_gets_it(
    fresh_database_url: str,
) -> None:
    pool = await create_pool(fresh_database_url, size=1)
    try:
        async with pool.acquire() as conn:
            await conn.execute("CREATE TABLE left_open (id int)")
            tx = conn.transaction()
            await tx.start()
            await conn.execute("INSERT INTO left_open VALUES (1)")
            # released here with the transaction neither committed nor rolled back
        async with pool.acquire() as conn:
            assert not conn.is_in_transaction()
            assert await conn.fetchval("SELECT count(*) FROM left_open") == 0
    finally:
        await pool.close()


async def test_a_failed_migration_leaves_its_lock_with_no_pooled_connection(
    fresh_database_url: str, tmp_path: Path
) -> None:
    """`migrate` holds a session-level advisory lock, and the service pools do not reset
    sessions on release: after a failed migration no lock is left held, and the next start
    migrates on. (The race this guards against in `migrate`, a lock granted just as a timeout
    or cancel strikes, cannot be staged deterministically.)"""
    (tmp_path / "001_ok.sql").write_text("CREATE TABLE fine (id int);")
    (tmp_path / "002_bad.sql").write_text("CREATE TABLE broken (id nonexistent_type);")
    pool = await create_pool(fresh_database_url, size=1)
    try:
        with pytest.raises(asyncpg.PostgresError):
            await migrate(pool, "probe", tmp_path)
        async with pool.acquire() as conn:
            held = await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            )
        assert held == 0
        (tmp_path / "002_bad.sql").write_text("CREATE TABLE mended (id int);")
        assert await migrate(pool, "probe", tmp_path) == ["002_bad.sql"]
    finally:
        await pool.close()
