"""The executor's schema (one per cluster): allocations, the epoch fence, tombstones, outbox."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg

from schemas.events import ReplicaAssignment

MIGRATIONS = Path(__file__).parent / "migrations"


def schema_for(cluster: str) -> str:
    return "executor_" + re.sub(r"[^a-z0-9_]", "_", cluster.lower())


@dataclass
class RunningJob:
    job_id: str
    attempt: int
    epoch: int
    tenant: str
    replicas: list[ReplicaAssignment]
    started_at: datetime
    ends_at: datetime
    outcome: str
    reason_code: str | None = None
    message: str | None = None

    @property
    def nodes(self) -> list[str]:
        return sorted({r.node_id for r in self.replicas})


class ExecutorStore:
    def __init__(self, pool: asyncpg.Pool, cluster: str) -> None:
        self.pool = pool
        self.schema = schema_for(cluster)

    async def load(self) -> tuple[list[RunningJob], int, set[str]]:
        s = self.schema
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(f'SELECT * FROM "{s}".allocations')
            epoch = await conn.fetchval(f'SELECT epoch FROM "{s}".fence') or 0
            tombs = {r["job_id"] for r in await conn.fetch(f'SELECT job_id FROM "{s}".tombstones')}
        jobs = [
            RunningJob(
                job_id=r["job_id"],
                attempt=r["attempt"],
                epoch=r["epoch"],
                tenant=r["tenant"],
                replicas=[ReplicaAssignment.model_validate(x) for x in json.loads(r["replicas"])],
                started_at=r["started_at"],
                ends_at=r["ends_at"],
                outcome=r["outcome"],
                reason_code=r["reason_code"],
                message=r["message"],
            )
            for r in rows
        ]
        return jobs, int(epoch), tombs

    async def write(
        self,
        conn: asyncpg.Connection,
        *,
        started: list[RunningJob],
        ended: list[str],
        epoch: int | None,
        tombstones: list[str],
    ) -> None:
        s = self.schema
        if started:
            await conn.executemany(
                f'INSERT INTO "{s}".allocations (job_id, attempt, epoch, replicas, tenant, '
                "started_at, ends_at, outcome, reason_code, message) "
                "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT (job_id) DO UPDATE "
                "SET attempt = EXCLUDED.attempt, epoch = EXCLUDED.epoch, "
                "replicas = EXCLUDED.replicas, started_at = EXCLUDED.started_at, "
                "ends_at = EXCLUDED.ends_at, outcome = EXCLUDED.outcome",
                [
                    (
                        j.job_id,
                        j.attempt,
                        j.epoch,
                        json.dumps([r.model_dump() for r in j.replicas]),
                        j.tenant,
                        j.started_at,
                        j.ends_at,
                        j.outcome,
                        j.reason_code,
                        j.message,
                    )
                    for j in started
                ],
            )
        if ended:
            await conn.execute(
                f'DELETE FROM "{s}".allocations WHERE job_id = ANY($1::text[])', ended
            )
        if epoch is not None:
            await conn.execute(
                f'INSERT INTO "{s}".fence (id, epoch) VALUES (1, $1) '
                "ON CONFLICT (id) DO UPDATE SET epoch = GREATEST(fence.epoch, EXCLUDED.epoch)",
                epoch,
            )
        if tombstones:
            await conn.executemany(
                f'INSERT INTO "{s}".tombstones (job_id) VALUES ($1) ON CONFLICT DO NOTHING',
                [(t,) for t in tombstones],
            )

    async def forget_old_tombstones(self, older_than_s: float = 3600) -> None:
        async with self.pool.acquire() as conn:
            await conn.execute(
                f'DELETE FROM "{self.schema}".tombstones WHERE at < now() - make_interval('
                "secs => $1)",
                older_than_s,
            )


def utcnow() -> datetime:
    return datetime.now(UTC)
