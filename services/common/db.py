"""PostgreSQL access shared by services: pools, per-service schemas and their migrations."""

from __future__ import annotations

import hashlib
from pathlib import Path

import asyncpg


async def keep_session(conn: asyncpg.Connection) -> None:
    """A pool's reset on release: nothing beyond what asyncpg always does (roll back an open
    transaction, forget listener callbacks). asyncpg's default reset sends `SELECT
    pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL` on every release, a round trip
    to PostgreSQL per batch of every service for session state no service keeps: statements
    run in transactions, locks are transaction-scoped, nothing listens or sets a session
    variable. The one session-level lock, `migrate`'s, is released by `migrate` or its
    connection is closed. (The meter's temporary COPY table, `meter/store.py`, is meant to
    live with the session, rows deleted at each commit; the default reset kept it too.)"""


async def create_pool(url: str, size: int = 4) -> asyncpg.Pool:
    pool = await asyncpg.create_pool(
        url,
        min_size=1,
        max_size=size,
        command_timeout=30,
        server_settings={"plan_cache_mode": "force_custom_plan"},
        reset=keep_session,
    )
    assert pool is not None
    return pool


async def migrate(pool: asyncpg.Pool, schema: str, directory: Path) -> list[str]:
    """Apply `directory/*.sql` in name order into `schema`, once each, under an advisory lock.

    Each service owns one schema; the SQL files use unqualified names and run with
    `search_path` set to that schema.
    """
    lock_key = int.from_bytes(hashlib.sha256(schema.encode()).digest()[:8], "big", signed=True)
    applied: list[str] = []
    # Read the (few, small) files before taking the lock; start-up only.
    scripts = [(p.name, p.read_text()) for p in sorted(directory.glob("*.sql"))]  # noqa: ASYNC240
    async with pool.acquire() as conn:
        try:
            await conn.execute("SELECT pg_advisory_lock($1)", lock_key)
            await _apply(conn, schema, scripts, applied)
            await conn.execute("SELECT pg_advisory_unlock($1)", lock_key)
        except BaseException:
            # The pool does not reset sessions (keep_session): a connection that may hold the
            # lock (granted as a timeout or cancel struck, or an unlock that failed) must not
            # serve anyone else. Closing it releases the lock.
            conn.terminate()
            raise
    return applied


async def _apply(
    conn: asyncpg.Connection, schema: str, scripts: list[tuple[str, str]], applied: list[str]
) -> None:
    await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    await conn.execute(
        f'CREATE TABLE IF NOT EXISTS "{schema}".schema_migrations '
        "(name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
    )
    done = {r["name"] for r in await conn.fetch(f'SELECT name FROM "{schema}".schema_migrations')}
    for name, sql in scripts:
        if name in done:
            continue
        async with conn.transaction():
            await conn.execute(f'SET LOCAL search_path TO "{schema}"')
            await conn.execute(sql)
            await conn.execute(f'INSERT INTO "{schema}".schema_migrations (name) VALUES ($1)', name)
        applied.append(name)
