"""The scheduler's own PostgreSQL schema: its snapshots (see snapshot.py), one row per
scheduler deployment (named by its leader lease)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import asyncpg

from services.common.db import migrate

MIGRATIONS = Path(__file__).parent / "migrations"
SCHEMA = "scheduler"


@dataclass(frozen=True)
class StoredSnapshot:
    taken_at: datetime
    progress: int
    taken_by: str
    body: bytes


class SnapshotStore:
    def __init__(self, pool: asyncpg.Pool, name: str) -> None:
        self.pool = pool
        self.name = name

    async def migrate(self) -> None:
        await migrate(self.pool, SCHEMA, MIGRATIONS)

    async def latest(self) -> StoredSnapshot | None:
        row = await self.pool.fetchrow(
            f"SELECT taken_at, progress, taken_by, body FROM {SCHEMA}.snapshots WHERE name = $1",
            self.name,
        )
        if row is None:
            return None
        return StoredSnapshot(row["taken_at"], row["progress"], row["taken_by"], bytes(row["body"]))

    async def latest_meta(self) -> tuple[datetime, str] | None:
        """When the latest snapshot was taken and by whom (no body)."""
        row = await self.pool.fetchrow(
            f"SELECT taken_at, taken_by FROM {SCHEMA}.snapshots WHERE name = $1", self.name
        )
        return None if row is None else (row["taken_at"], row["taken_by"])

    async def save(
        self, body: bytes, progress: int, taken_by: str, unusable: datetime | None = None
    ) -> bool:
        """Stores `body` unless the stored snapshot covers more of the log; whether it did.
        `unusable` names (by when it was taken) a stored snapshot this process could not use
        (of another log, or unreadable): it is replaced whatever its progress."""
        stored = await self.pool.fetchval(
            f"""
            INSERT INTO {SCHEMA}.snapshots (name, taken_at, progress, taken_by, body)
            VALUES ($1, now(), $2, $3, $4)
            ON CONFLICT (name) DO UPDATE
               SET taken_at = excluded.taken_at, progress = excluded.progress,
                   taken_by = excluded.taken_by, body = excluded.body
             WHERE {SCHEMA}.snapshots.progress <= excluded.progress
                OR {SCHEMA}.snapshots.taken_at = $5
            RETURNING true
            """,
            self.name,
            progress,
            taken_by,
            body,
            unusable,
        )
        return bool(stored)
