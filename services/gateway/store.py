"""The gateway's schema `gateway`: the job read model and each job's event history."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import structlog
from pydantic import BaseModel, ValidationError

from schemas.envelope import Envelope
from schemas.job import JobSpec, JobState
from services.common.db import migrate
from services.common.deadletter import Received
from services.gateway.projection import EventLine, JobView, Placement

log = structlog.get_logger()

SCHEMA = "gateway"
MIGRATIONS = Path(__file__).parent / "migrations"

# A stored spec is not read back whole (parsing it was most of what reading a view cost): only
# what the projection needs of it, the type the job asks for (its own column) and the memory its
# first run asked for. A row from before the `wanted_type` column gives its spec instead.
_COLS = (
    "job_id, tenant, state, attempt, ended_attempt, reason_code, message, cluster, nodes, "
    "submitted_at, updated_at, placement, spec IS NOT NULL AS spec_stored, wanted_type, "
    "CASE WHEN wanted_type IS NULL THEN spec END AS spec, "
    "CASE WHEN jsonb_typeof(spec -> 'resources' -> 'memory_gb') = 'number'"
    " THEN (spec -> 'resources' ->> 'memory_gb')::float8 END AS memory_gb"
)


async def migrate_gateway(pool: asyncpg.Pool) -> None:
    await migrate(pool, SCHEMA, MIGRATIONS)


def _view(row: asyncpg.Record) -> JobView:
    # Only a row from before `wanted_type` gives its spec (see _COLS). The gateway wrote it
    # after validating it: pydantic parses the stored text itself.
    spec = JobSpec.model_validate_json(row["spec"]) if row["spec"] else None
    return JobView(
        job_id=row["job_id"],
        tenant=row["tenant"],
        state=JobState(row["state"]),
        submitted_at=row["submitted_at"],
        updated_at=row["updated_at"],
        spec=spec,
        attempt=row["attempt"],
        ended_attempt=row["ended_attempt"],
        reason_code=row["reason_code"],
        message=row["message"],
        cluster=row["cluster"],
        nodes=tuple(row["nodes"] or ()),
        placement=Placement.from_json(json.loads(row["placement"])) if row["placement"] else None,
        spec_stored=row["spec_stored"],
        wanted=row["wanted_type"],
        first_memory_gb=row["memory_gb"],
    )


async def claim_lines(conn: asyncpg.Connection, lines: Sequence[EventLine]) -> set[str]:
    """Store event lines; return the ids not seen before (the projection applies only those)."""
    if not lines:
        return set()
    rows = await conn.fetch(
        "INSERT INTO gateway.job_events (event_id, job_id, at, type, state, reason_code, message,"
        " for_job) SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::text[],"
        " $5::text[], $6::text[], $7::text[], $8::text[]) ON CONFLICT DO NOTHING"
        " RETURNING event_id",
        [ln.event_id for ln in lines],
        [ln.job_id for ln in lines],
        [ln.at for ln in lines],
        [ln.type for ln in lines],
        [ln.state.value if ln.state else None for ln in lines],
        [ln.reason_code for ln in lines],
        [ln.message for ln in lines],
        [ln.for_job for ln in lines],
    )
    return {r["event_id"] for r in rows}


async def lock_views(conn: asyncpg.Connection, job_ids: Iterable[str]) -> dict[str, JobView]:
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    rows = await conn.fetch(
        f"SELECT {_COLS} FROM gateway.jobs WHERE job_id = ANY($1::text[]) ORDER BY job_id "
        "FOR UPDATE",
        ids,
    )
    return {r["job_id"]: _view(r) for r in rows}


async def lock_unknown(conn: asyncpg.Connection, job_ids: Iterable[str]) -> dict[str, JobView]:
    """Serialize the projectors that find no view for these jobs (one creates it, another may
    keep early events about it), then read again what a replica committed meanwhile."""
    await conn.execute(
        "SELECT pg_advisory_xact_lock(hashtext('gateway.jobs:' || j))"
        " FROM (SELECT j FROM unnest($1::text[]) AS j ORDER BY j) AS ids",
        sorted(set(job_ids)),
    )
    return await lock_views(conn, job_ids)


# Events about jobs not heard of are dropped after this long (another producer's stray ids).
EARLY_EVENTS_KEPT = timedelta(days=1)


async def keep_early(conn: asyncpg.Connection, early: Sequence[tuple[Received, Any]]) -> int:
    """Keep lifecycle events read before their job's view exists (see 011_early_events.sql),
    as their envelopes were decoded (upcast to this version), and drop those kept too long.
    Returns the bytes kept."""
    await conn.execute(
        "DELETE FROM gateway.early_events WHERE received_at < now() - $1::interval",
        EARLY_EVENTS_KEPT,
    )
    values = [_as_decoded(got) for got, _ in early]
    await conn.execute(
        "INSERT INTO gateway.early_events (event_id, job_id, topic, value) SELECT * FROM"
        " unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) ON CONFLICT DO NOTHING",
        [got.envelope.event_id for got, _ in early],
        [str(p.job_id) for _, p in early],
        [got.record.topic for got, _ in early],
        values,
    )
    return sum(map(len, values))


def _as_decoded(got: Received) -> bytes:
    """The envelope as decoded. One read in one pass (its payload a model, not a dict) was in
    this version as it came: its bytes are kept as they came, fields this version does not
    know included, rather than the model dumped again."""
    if isinstance(got.envelope.payload, dict) or not isinstance(got.record.value, bytes):
        return got.envelope.model_dump_json().encode()
    return got.record.value


async def trim_early(conn: asyncpg.Connection, max_rows: int, max_bytes: int) -> int:
    """Drop the oldest kept early events beyond the newest `max_rows`, or beyond the newest
    `max_bytes` of stored envelopes (a record may be up to a MiB); returns how many. Reads
    every kept row's size (not its value), so it is run now and then (Projector), not for
    every batch."""
    status = await conn.execute(
        "DELETE FROM gateway.early_events WHERE event_id IN (SELECT event_id FROM ("
        " SELECT event_id, row_number() OVER newest AS n, sum(octet_length(value)) OVER newest"
        " AS b FROM gateway.early_events"
        " WINDOW newest AS (ORDER BY received_at DESC, event_id DESC)) AS kept"
        " WHERE n > $1 OR b > $2)",
        max(0, max_rows),
        max(0, max_bytes),
    )
    return int(status.split()[-1])


async def take_early(
    conn: asyncpg.Connection, job_ids: Iterable[str], models: Mapping[str, type[BaseModel]]
) -> tuple[list[tuple[Envelope, Any]], int]:
    """Remove and return the kept events about these jobs, and how many could not be read
    again (kept by another version of the gateway; dropped, with a warning)."""
    rows = await conn.fetch(
        "DELETE FROM gateway.early_events WHERE job_id = ANY($1::text[])"
        " RETURNING event_id, topic, value",
        sorted(job_ids),
    )
    taken: list[tuple[Envelope, Any]] = []
    dropped = 0
    for r in rows:
        try:
            env = Envelope.model_validate_json(r["value"])
            taken.append((env, models[r["topic"]].model_validate(env.payload)))
        except (ValidationError, KeyError) as exc:
            dropped += 1
            log.warning("kept event unreadable, dropped", event_id=r["event_id"], error=str(exc))
    return taken, dropped


async def upsert_views(conn: asyncpg.Connection, views: Sequence[JobView]) -> None:
    """Upsert these views (distinct job ids) in one statement: one plan for the batch, where a
    statement per view was planned afresh for each (plans are always custom, common/db.py).
    A view's nodes travel as a JSON array, since arrays of arrays cannot be ragged."""
    if not views:
        return
    rows = [_row(v) for v in sorted(views, key=lambda v: v.job_id)]  # lock_views' order
    await conn.execute(
        'INSERT INTO gateway.jobs (job_id, tenant, project, "user", queue, name, state, attempt,'
        " reason_code, message, cluster, nodes, replicas, accelerators, idempotency_key, spec,"
        " submitted_at, updated_at, ended_attempt, placement, accelerator_type, wanted_type)"
        " SELECT u.job_id, u.tenant, u.project, u.usr, u.queue, u.name, u.state, u.attempt,"
        " u.reason_code, u.message, u.cluster, ARRAY(SELECT jsonb_array_elements_text(u.nodes)),"
        " u.replicas, u.accelerators, u.idempotency_key, u.spec, u.submitted_at,"
        " u.updated_at, u.ended_attempt, u.placement, u.accelerator_type, u.wanted_type"
        " FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],"
        " $7::text[], $8::int[], $9::text[], $10::text[], $11::text[], $12::jsonb[], $13::int[],"
        " $14::float8[], $15::text[], $16::jsonb[], $17::timestamptz[], $18::timestamptz[],"
        " $19::int[], $20::jsonb[], $21::text[], $22::text[]) AS u(job_id, tenant, project, usr,"
        " queue, name, state, attempt, reason_code, message, cluster, nodes, replicas,"
        " accelerators, idempotency_key, spec, submitted_at, updated_at, ended_attempt,"
        " placement, accelerator_type, wanted_type)"
        " ON CONFLICT (job_id) DO UPDATE SET"
        " state = EXCLUDED.state, attempt = EXCLUDED.attempt,"
        " placement = EXCLUDED.placement, accelerator_type = EXCLUDED.accelerator_type,"
        " ended_attempt = EXCLUDED.ended_attempt, reason_code = EXCLUDED.reason_code,"
        " message = EXCLUDED.message, cluster = EXCLUDED.cluster, nodes = EXCLUDED.nodes,"
        " spec = COALESCE(gateway.jobs.spec, EXCLUDED.spec),"
        " wanted_type = COALESCE(gateway.jobs.wanted_type, EXCLUDED.wanted_type),"
        " project = COALESCE(gateway.jobs.project, EXCLUDED.project),"
        ' "user" = COALESCE(gateway.jobs."user", EXCLUDED."user"),'
        " queue = COALESCE(gateway.jobs.queue, EXCLUDED.queue),"
        " name = COALESCE(gateway.jobs.name, EXCLUDED.name),"
        " replicas = COALESCE(gateway.jobs.replicas, EXCLUDED.replicas),"
        " accelerators = COALESCE(gateway.jobs.accelerators, EXCLUDED.accelerators),"
        " updated_at = EXCLUDED.updated_at",
        *(list(column) for column in zip(*rows, strict=True)),
    )


def _row(v: JobView) -> tuple[Any, ...]:
    s = v.spec
    return (
        v.job_id,
        v.tenant,
        s.project if s else None,
        s.user if s else None,
        s.queue if s else None,
        s.name if s else None,
        v.state.value,
        v.attempt,
        v.reason_code,
        v.message,
        v.cluster,
        json.dumps(list(v.nodes)),
        s.replicas if s else None,
        s.total_accelerators if s else None,
        s.idempotency_key if s else None,
        # The upsert keeps a stored spec (COALESCE): one read from the row is not sent back.
        s.model_dump_json(exclude_none=True) if s and not v.spec_stored else None,
        v.submitted_at,
        v.updated_at,
        v.ended_attempt,
        json.dumps(v.placement.as_json()) if v.placement is not None else None,
        v.accelerator_type,
        v.asked_type,
    )


async def insert_submitted(pool: asyncpg.Pool, view: JobView, line: EventLine) -> str | None:
    """Record a job the gateway just accepted and its first history line. Returns the existing
    job id instead when the tenant already used this idempotency key."""
    key = view.spec.idempotency_key if view.spec else None
    async with pool.acquire() as conn:
        try:
            async with conn.transaction():
                if key and (existing := await _keyed(conn, view.tenant, key)):
                    return existing
                await upsert_views(conn, [view])
                await claim_lines(conn, [line])
        except asyncpg.UniqueViolationError:
            # A concurrent retry with the same key committed first (the unique index on
            # tenant and key decides): answer with its job.
            if key and (existing := await _keyed(conn, view.tenant, key)):
                return existing
            raise
    return None


async def _keyed(conn: asyncpg.Connection, tenant: str, key: str) -> str | None:
    found = await conn.fetchval(
        "SELECT job_id FROM gateway.jobs WHERE tenant = $1 AND idempotency_key = $2", tenant, key
    )
    return None if found is None else str(found)


async def forget(pool: asyncpg.Pool, job_id: str) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("DELETE FROM gateway.job_events WHERE job_id = $1", job_id)
        await conn.execute("DELETE FROM gateway.jobs WHERE job_id = $1", job_id)


async def get_job(pool: asyncpg.Pool, job_id: str) -> asyncpg.Record | None:
    return await pool.fetchrow(
        'SELECT job_id, tenant, project, "user", queue, name, state, reason_code, message,'
        " cluster, nodes, replicas, accelerators, spec, submitted_at, updated_at"
        " FROM gateway.jobs WHERE job_id = $1",
        job_id,
    )


async def history(
    pool: asyncpg.Pool, job_id: str, can_read: Callable[[str], bool]
) -> list[dict[str, Any]]:
    """A job's history lines, as a reader who may read the tenants `can_read` accepts sees
    them: a line about a preemption made for another tenant's job does not name that job."""
    rows = await pool.fetch(
        "SELECT event_id, job_id, at, type, state, reason_code, message, for_job"
        " FROM gateway.job_events WHERE job_id = $1 ORDER BY at, event_id",
        job_id,
    )
    return await redact(pool, [dict(r) for r in rows], can_read)


OTHER_JOB = "another tenant's job"


async def redact(
    pool: asyncpg.Pool, lines: list[dict[str, Any]], can_read: Callable[[str], bool]
) -> list[dict[str, Any]]:
    """Lines whose `for_job` the reader may not read (or that the read model does not know)
    lose that job's id from their message."""
    others = {ln["for_job"] for ln in lines if ln.get("for_job")}
    if not others:
        return lines
    owners = {
        r["job_id"]: r["tenant"]
        for r in await pool.fetch(
            "SELECT job_id, tenant FROM gateway.jobs WHERE job_id = ANY($1::text[])", list(others)
        )
    }
    for ln in lines:
        other = ln.get("for_job")
        if other and not (other in owners and can_read(owners[other])):
            ln["for_job"] = None
            if ln.get("message"):
                ln["message"] = ln["message"].replace(f"job {other}", OTHER_JOB)
                ln["message"] = ln["message"].replace(other, OTHER_JOB)
    return lines


async def list_jobs(
    pool: asyncpg.Pool, *, tenant: str | None, state: str | None, queue: str | None, limit: int
) -> list[asyncpg.Record]:
    where, args = [], []
    for column, value in (("tenant", tenant), ("state", state), ("queue", queue)):
        if value is not None:
            args.append(value)
            where.append(f"{column} = ${len(args)}")
    args.append(limit)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    return await pool.fetch(
        "SELECT job_id, tenant, project, queue, name, state, replicas, accelerators, cluster,"
        f" submitted_at, updated_at FROM gateway.jobs {clause}"
        f" ORDER BY submitted_at DESC LIMIT ${len(args)}",
        *args,
    )
