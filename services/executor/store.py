"""The executor's schema (one per cluster): allocations, the epoch fence, tombstones, outbox."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import asyncpg

from schemas.events import ReplicaAssignment
from services.executor.pools import Member, PoolBook
from services.executor.simulated import RunEnd

MIGRATIONS = Path(__file__).parent / "migrations"

# (job id, attempt): a run's natural key.
RunKey = tuple[str, int]


def schema_for(cluster: str) -> str:
    return "executor_" + re.sub(r"[^a-z0-9_]", "_", cluster.lower())


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint the run was signalled to take: it saves the state of `at` and is complete
    at `done_at`; `stop_at` is when the order that asked for it said the stop would follow."""

    at: datetime
    done_at: datetime
    stop_at: datetime | None = None


@dataclass
class RunningJob:
    job_id: str
    attempt: int
    epoch: int
    tenant: str
    replicas: list[ReplicaAssignment]
    started_at: datetime
    ends_at: datetime
    end: RunEnd
    reason_code: str | None = None
    message: str | None = None
    exit_code: int | None = None
    step_s: float = 1.0
    checkpoint_s: float = 10.0
    checkpoint_every_s: float | None = None
    checkpoint: Checkpoint | None = None
    # job.started announced (a simulated run starts with its placement; a Kubernetes run when
    # every pod of the gang runs).
    started: bool = True
    # The inference service this run is a replica of (its `qm_service` label), and when it
    # serves (the simulated fleet reports it ready then).
    service: str | None = None
    ready_at: datetime | None = None

    @property
    def key(self) -> RunKey:
        return (self.job_id, self.attempt)

    @property
    def nodes(self) -> list[str]:
        return sorted({r.node_id for r in self.replicas})


_COLUMNS = (
    "job_id, attempt, epoch, replicas, tenant, started_at, ends_at, outcome, reason_code, "
    "message, exit_code, step_s, checkpoint_s, checkpoint_every_s, checkpoint_at, "
    "checkpoint_done_at, checkpoint_stop_at, started, service, ready_at"
)

# A new attempt of a job takes over its row whole.
_REPLACE = ", ".join(f"{c} = EXCLUDED.{c}" for c in _COLUMNS.split(", ")[1:])
# The columns' types, in _COLUMNS' order, for a batch sent as one array per column.
_UNNEST = ", ".join(
    f"${i}::{t}[]"
    for i, t in enumerate(
        (
            "text", "int", "bigint", "jsonb", "text", "timestamptz", "timestamptz", "text",
            "text", "text", "int", "float8", "float8", "float8", "timestamptz", "timestamptz",
            "timestamptz", "bool", "text", "timestamptz",
        ),
        start=1,
    )
)  # fmt: skip


def _row(j: RunningJob) -> tuple[object, ...]:
    c = j.checkpoint
    return (
        j.job_id,
        j.attempt,
        j.epoch,
        json.dumps([r.model_dump() for r in j.replicas]),
        j.tenant,
        j.started_at,
        j.ends_at,
        j.end.value,
        j.reason_code,
        j.message,
        j.exit_code,
        j.step_s,
        j.checkpoint_s,
        j.checkpoint_every_s,
        c.at if c else None,
        c.done_at if c else None,
        c.stop_at if c else None,
        j.started,
        j.service,
        j.ready_at,
    )


def _job(r: asyncpg.Record) -> RunningJob:
    checkpoint = None
    if r["checkpoint_at"] is not None:
        checkpoint = Checkpoint(
            r["checkpoint_at"], r["checkpoint_done_at"], r["checkpoint_stop_at"]
        )
    return RunningJob(
        job_id=r["job_id"],
        attempt=r["attempt"],
        epoch=r["epoch"],
        tenant=r["tenant"],
        replicas=[ReplicaAssignment.model_validate(x) for x in json.loads(r["replicas"])],
        started_at=r["started_at"],
        ends_at=r["ends_at"],
        end=RunEnd(r["outcome"]),
        reason_code=r["reason_code"],
        message=r["message"],
        exit_code=r["exit_code"],
        step_s=r["step_s"],
        checkpoint_s=r["checkpoint_s"],
        checkpoint_every_s=r["checkpoint_every_s"],
        checkpoint=checkpoint,
        started=r["started"],
        service=r["service"],
        ready_at=r["ready_at"],
    )


class ExecutorStore:
    def __init__(self, pool: asyncpg.Pool, cluster: str) -> None:
        self.pool = pool
        self.schema = schema_for(cluster)

    async def load(self) -> tuple[list[RunningJob], int, dict[str, float]]:
        s = self.schema
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(f'SELECT * FROM "{s}".allocations')
            epoch = await conn.fetchval(f'SELECT epoch FROM "{s}".fence') or 0
            tombs = {
                r["job_id"]: r["at"].timestamp()
                for r in await conn.fetch(f'SELECT job_id, at FROM "{s}".tombstones')
            }
        return [_job(r) for r in rows], int(epoch), tombs

    async def write(
        self,
        conn: asyncpg.Connection,
        *,
        started: list[RunningJob],
        ended: list[RunKey],
        epoch: int | None,
        tombstones: list[str],
        checkpointed: Sequence[RunningJob] = (),
        announced: Sequence[RunningJob] = (),
    ) -> None:
        """One batch's net change. A run started and ended within the batch is never written;
        an ended run is deleted by its attempt, so a new attempt of its job written in the same
        batch survives."""
        s = self.schema
        gone = set(ended)
        begun = {j.key for j in started}
        if gone - begun:
            await conn.execute(
                f'DELETE FROM "{s}".allocations AS a USING unnest($1::text[], $2::int[]) '
                "AS e(job_id, attempt) WHERE a.job_id = e.job_id AND a.attempt = e.attempt",
                [k[0] for k in gone - begun],
                [k[1] for k in gone - begun],
            )
        # Each write below is one statement for the batch (one plan; a statement per row was
        # planned afresh for each, common/db.py). A row per job id, the last one listed, as
        # the rows applied one by one left it: one statement cannot upsert a row twice.
        # A checkpointed run started in this batch is written whole.
        rows = list({j.job_id: _row(j) for j in started if j.key not in gone}.values())
        if rows:
            await conn.execute(
                f'INSERT INTO "{s}".allocations ({_COLUMNS}) SELECT * FROM unnest({_UNNEST}) '
                f"ON CONFLICT (job_id) DO UPDATE SET {_REPLACE}",
                *(list(column) for column in zip(*rows, strict=True)),
            )
        marks = {
            j.key: (j.job_id, j.attempt, c.at, c.done_at, c.stop_at)
            for j in checkpointed
            if j.key not in gone and j.key not in begun and (c := j.checkpoint) is not None
        }
        if marks:
            await conn.execute(
                f'UPDATE "{s}".allocations AS a SET checkpoint_at = u.at, '
                "checkpoint_done_at = u.done_at, checkpoint_stop_at = u.stop_at "
                "FROM unnest($1::text[], $2::int[], $3::timestamptz[], $4::timestamptz[], "
                "$5::timestamptz[]) AS u(job_id, attempt, at, done_at, stop_at) "
                "WHERE a.job_id = u.job_id AND a.attempt = u.attempt",
                *(list(column) for column in zip(*marks.values(), strict=True)),
            )
        shown = {
            j.key: (j.job_id, j.attempt, j.started_at)
            for j in announced
            if j.key not in gone and j.key not in begun
        }
        if shown:
            await conn.execute(
                f'UPDATE "{s}".allocations AS a SET started = true, started_at = u.at '
                "FROM unnest($1::text[], $2::int[], $3::timestamptz[]) AS u(job_id, attempt, at) "
                "WHERE a.job_id = u.job_id AND a.attempt = u.attempt",
                *(list(column) for column in zip(*shown.values(), strict=True)),
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

    async def load_pools(
        self,
    ) -> tuple[list[Member], dict[str, tuple[int, int]], dict[str, datetime]]:
        """The elastic pools' members, (desired size, next node number) per pool, and when the
        newest decision applied to each was taken."""
        s = self.schema
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(f'SELECT * FROM "{s}".pool_nodes')
            sizes = await conn.fetch(f'SELECT * FROM "{s}".pool_sizes')
        members = [
            Member(r["node_id"], r["pool"], r["requested_at"], r["ready_at"], r["stockout"])
            for r in rows
        ]
        applied = {r["pool"]: r["applied_at"] for r in sizes if r["applied_at"] is not None}
        return members, {r["pool"]: (r["desired"], r["next_seq"]) for r in sizes}, applied

    async def save_pools(self, book: PoolBook) -> None:
        """The pools as they are now, whole (a few hundred rows at most), in one transaction."""
        s = self.schema
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(f'DELETE FROM "{s}".pool_nodes')
            await conn.executemany(
                f'INSERT INTO "{s}".pool_nodes (node_id, pool, requested_at, ready_at, stockout) '
                "VALUES ($1, $2, $3, $4, $5)",
                [
                    (m.node_id, m.pool, m.requested_at, m.ready_at, m.stockout)
                    for m in book.members.values()
                ],
            )
            await conn.executemany(
                f'INSERT INTO "{s}".pool_sizes (pool, desired, next_seq, applied_at) '
                "VALUES ($1, $2, $3, $4) ON CONFLICT (pool) DO UPDATE SET "
                "desired = EXCLUDED.desired, next_seq = EXCLUDED.next_seq, "
                "applied_at = EXCLUDED.applied_at",
                [
                    (name, book.desired[name], book.next_seq[name], book.applied_at.get(name))
                    for name in book.pools
                ],
            )

    async def forget_tombstones(self, before: datetime) -> int:
        """Delete tombstones written before `before`; returns how many."""
        status = await self.pool.execute(
            f'DELETE FROM "{self.schema}".tombstones WHERE at < $1', before
        )
        return int(status.split()[-1])


def utcnow() -> datetime:
    return datetime.now(UTC)
