"""PostgreSQL access shared by services: pools, per-service schemas and their migrations."""

from __future__ import annotations

import hashlib
from pathlib import Path

import asyncpg


async def keep_session(conn: asyncpg.Connection) -> None:
    """A pool's reset on release: nothing beyond what asyncpg always does (roll back an open
    transaction, drop listeners). asyncpg's default reset sends `SELECT
    pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL` on every release, a round trip
    to PostgreSQL per batch of every service for session state no service keeps: statements
    run in transactions, locks are transaction-scoped, nothing listens or sets a session
    variable. The one session-level lock, `migrate`'s, is released by `migrate` itself or the
    connection is closed."""


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
        await conn.execute("SELECT pg_advisory_lock($1)", lock_key)
        try:
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            await conn.execute(
                f'CREATE TABLE IF NOT EXISTS "{schema}".schema_migrations '
                "(name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {
                r["name"]
                for r in await conn.fetch(f'SELECT name FROM "{schema}".schema_migrations')
            }
            for name, sql in scripts:
                if name in done:
                    continue
                async with conn.transaction():
                    await conn.execute(f'SET LOCAL search_path TO "{schema}"')
                    await conn.execute(sql)
                    await conn.execute(
                        f'INSERT INTO "{schema}".schema_migrations (name) VALUES ($1)', name
                    )
                applied.append(name)
        finally:
            try:
                await conn.execute("SELECT pg_advisory_unlock($1)", lock_key)
            except BaseException:
                # The pool does not reset sessions (keep_session): a connection that may
                # still hold the lock must not serve anyone else.
                conn.terminate()
                raise
    return applied
