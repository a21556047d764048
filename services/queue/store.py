"""The queue's PostgreSQL schema `queue`: jobs, their history, rejections, outbox. Batched."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import asyncpg

from schemas.job import JobSpec, JobState
from schemas.usage import BudgetUnit
from services.queue.budgets import BudgetBlock
from services.queue.lifecycle import HistoryEntry, JobRecord

SCHEMA = "queue"
MIGRATIONS = Path(__file__).parent / "migrations"

_COLUMNS = (
    "job_id, tenant, state, attempt, cluster, cancel_requested, reason_code, message, "
    "submitted_at, updated_at, requeues, excluded_nodes, ended_attempt, failures, "
    "claim_preemptions"
)


def _record(row: asyncpg.Record) -> JobRecord:
    return JobRecord(
        job_id=row["job_id"],
        tenant=row["tenant"],
        state=JobState(row["state"]),
        attempt=row["attempt"],
        cluster=row["cluster"],
        cancel_requested=row["cancel_requested"],
        reason_code=row["reason_code"],
        message=row["message"],
        submitted_at=row["submitted_at"],
        updated_at=row["updated_at"],
        requeues=row["requeues"],
        excluded_nodes=tuple(row["excluded_nodes"]),
        ended_attempt=row["ended_attempt"],
        failures=row["failures"],
        claim_preemptions=row["claim_preemptions"],
    )


async def lock_jobs(conn: asyncpg.Connection, job_ids: Iterable[str]) -> dict[str, JobRecord]:
    """Take a transaction-scoped advisory lock on each of these job ids, then read their rows.

    The locks serialize every transaction that writes a job's row, its history or its early
    cancel (all of them go through here first): two consumers or replicas touching the same
    job wait for each other, even before its row exists (a cancel racing its own submission).
    The rows are read in a statement of its own after the locks are granted, so under READ
    COMMITTED (the outbox transaction's level) it sees what the previous holder committed. No
    row lock (FOR UPDATE) is taken: it would add nothing but a WAL record and a dirtied page
    for every row read, written or not (4.5 per job in the e2e bench, docs/performance.md).
    The locks are taken in the order of their keys, so two batches never wait on each other
    in a cycle, whatever ids share a key."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    await conn.execute(
        "SELECT pg_advisory_xact_lock(k) FROM "
        "(SELECT DISTINCT hashtext(id) AS k FROM unnest($1::text[]) AS id ORDER BY 1) AS s",
        ids,
    )
    rows = await conn.fetch(
        f"SELECT {_COLUMNS} FROM queue.jobs WHERE job_id = ANY($1::text[])",
        ids,
    )
    return {r["job_id"]: _record(r) for r in rows}


async def find_by_idempotency(
    conn: asyncpg.Connection, keys: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], str]:
    pairs = sorted(set(keys))
    if not pairs:
        return {}
    rows = await conn.fetch(
        "SELECT j.tenant, j.idempotency_key, j.job_id FROM queue.jobs j "
        "JOIN unnest($1::text[], $2::text[]) AS k(tenant, key) "
        "ON j.tenant = k.tenant AND j.idempotency_key = k.key",
        [p[0] for p in pairs],
        [p[1] for p in pairs],
    )
    return {(r["tenant"], r["idempotency_key"]): r["job_id"] for r in rows}


async def insert_jobs(conn: asyncpg.Connection, jobs: Sequence[tuple[JobRecord, JobSpec]]) -> None:
    if not jobs:
        return
    await conn.copy_records_to_table(
        "jobs",
        schema_name=SCHEMA,
        columns=[
            "job_id",
            "tenant",
            "idempotency_key",
            "state",
            "attempt",
            "cluster",
            "cancel_requested",
            "reason_code",
            "message",
            "spec",
            "submitted_at",
            "updated_at",
        ],
        records=[
            (
                r.job_id,
                r.tenant,
                s.idempotency_key,
                r.state.value,
                r.attempt,
                r.cluster,
                r.cancel_requested,
                r.reason_code,
                r.message,
                s.model_dump_json(exclude_none=True),
                r.submitted_at,
                r.updated_at,
            )
            for r, s in jobs
        ],
    )


async def update_jobs(conn: asyncpg.Connection, records: Sequence[JobRecord]) -> None:
    if not records:
        return
    await conn.execute(
        "UPDATE queue.jobs AS j SET state = u.state, attempt = u.attempt, cluster = u.cluster, "
        "cancel_requested = u.cancel_requested, reason_code = u.reason_code, "
        "message = u.message, updated_at = u.updated_at, requeues = u.requeues, "
        "excluded_nodes = string_to_array(u.excluded, ','), ended_attempt = u.ended, "
        "failures = u.failures, claim_preemptions = u.claim_preemptions "
        "FROM unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::bool[], $6::text[], "
        "$7::text[], $8::timestamptz[], $9::int[], $10::text[], $11::int[], $12::int[], "
        "$13::int[]) AS u(job_id, state, attempt, cluster, cancel_requested, reason_code, "
        "message, updated_at, requeues, excluded, ended, failures, claim_preemptions) "
        "WHERE j.job_id = u.job_id",
        [r.job_id for r in records],
        [r.state.value for r in records],
        [r.attempt for r in records],
        [r.cluster for r in records],
        [r.cancel_requested for r in records],
        [r.reason_code for r in records],
        [r.message for r in records],
        [r.updated_at for r in records],
        [r.requeues for r in records],
        # unnest cannot take a ragged array of arrays: node ids (no commas) travel joined.
        [",".join(r.excluded_nodes) for r in records],
        [r.ended_attempt for r in records],
        [r.failures for r in records],
        [r.claim_preemptions for r in records],
    )


async def update_specs(conn: asyncpg.Connection, specs: Mapping[str, JobSpec]) -> None:
    """Specs the queue changed (more memory after an out-of-memory run): later requeues and
    restarts carry the changed one."""
    if not specs:
        return
    ids = sorted(specs)
    await conn.execute(
        "UPDATE queue.jobs AS j SET spec = u.spec::jsonb "
        "FROM unnest($1::text[], $2::text[]) AS u(job_id, spec) WHERE j.job_id = u.job_id",
        ids,
        [specs[i].model_dump_json(exclude_none=True) for i in ids],
    )


async def job_specs(conn: asyncpg.Connection, job_ids: Iterable[str]) -> dict[str, JobSpec]:
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    rows = await conn.fetch(
        "SELECT job_id, spec FROM queue.jobs WHERE job_id = ANY($1::text[])", ids
    )
    return {r["job_id"]: JobSpec.model_validate(json.loads(r["spec"])) for r in rows}


async def add_history(conn: asyncpg.Connection, entries: Sequence[HistoryEntry]) -> None:
    if not entries:
        return
    await conn.copy_records_to_table(
        "job_history",
        schema_name=SCHEMA,
        columns=["job_id", "at", "state", "event_type", "event_id", "reason_code", "message"],
        records=[
            (e.job_id, e.at, e.state.value, e.event_type, e.event_id, e.reason_code, e.message)
            for e in entries
        ],
    )


async def add_rejections(
    conn: asyncpg.Connection, rows: Sequence[tuple[str, str | None, str | None, str, str, object]]
) -> None:
    """rows: (event_id, job_id, tenant, reason_code, message, at)."""
    if rows:
        await conn.executemany(
            "INSERT INTO queue.rejections (event_id, job_id, tenant, reason_code, message, at) "
            "VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
            rows,
        )


async def take_early_cancels(conn: asyncpg.Connection, job_ids: Iterable[str]) -> dict[str, str]:
    """Cancels that arrived before these jobs did; they are consumed by this call."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    rows = await conn.fetch(
        "DELETE FROM queue.early_cancels WHERE job_id = ANY($1::text[]) "
        "RETURNING job_id, requested_by",
        ids,
    )
    return {r["job_id"]: r["requested_by"] for r in rows}


async def add_early_cancels(conn: asyncpg.Connection, cancels: Sequence[tuple[str, str]]) -> None:
    if cancels:
        await conn.executemany(
            "INSERT INTO queue.early_cancels (job_id, requested_by) VALUES ($1, $2) "
            "ON CONFLICT DO NOTHING",
            cancels,
        )


async def budget_blocks(conn: asyncpg.Connection) -> dict[str, BudgetBlock]:
    rows = await conn.fetch(
        'SELECT budget_id, tenant, project, month, unit, "limit", used, currency '
        "FROM queue.budget_blocks"
    )
    return {
        r["budget_id"]: BudgetBlock(
            r["budget_id"],
            r["tenant"],
            r["project"],
            r["month"],
            BudgetUnit(r["unit"]),
            r["limit"],
            r["used"],
            r["currency"],
        )
        for r in rows
    }


async def save_budget_blocks(conn: asyncpg.Connection, blocks: Iterable[BudgetBlock]) -> None:
    await conn.executemany(
        'INSERT INTO queue.budget_blocks (budget_id, tenant, project, month, unit, "limit", '
        "used, currency) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (budget_id) DO "
        "UPDATE SET tenant = EXCLUDED.tenant, project = EXCLUDED.project, month = EXCLUDED.month,"
        ' unit = EXCLUDED.unit, "limit" = EXCLUDED."limit", used = EXCLUDED.used, '
        "currency = EXCLUDED.currency",
        [
            (b.budget_id, b.tenant, b.project, b.month, b.unit.value, b.limit, b.used, b.currency)
            for b in blocks
        ],
    )
