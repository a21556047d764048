"""The preemptor's PostgreSQL schema `preemptor`: job facts, the epoch fence and the
preemptions with their durable timers (plus the outbox and processed events of
services.common.outbox). Every function runs inside the caller's transaction, except
`anything_due`, the timer's look before it opens one."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import asyncpg

from schemas.events import PreemptionRequested
from services.common.housekeeping import rows_pruner
from services.preemptor.guards import JobFacts, Request, State
from services.preemptor.intake import Incoming, RunEnd, to_request

SCHEMA = "preemptor"
MIGRATIONS = Path(__file__).parent / "migrations"


@dataclass(frozen=True)
class Tracked:
    """A stored preemption: the request and where it stands."""

    request: Request
    state: State
    trace_id: str
    received_at: datetime
    stop_at: datetime | None


async def fence_epoch(conn: asyncpg.Connection) -> int:
    epoch = await conn.fetchval("SELECT epoch FROM preemptor.fence WHERE id = 1")
    return int(epoch or 0)


async def raise_fence(conn: asyncpg.Connection, epoch: int) -> None:
    await conn.execute(
        "INSERT INTO preemptor.fence (id, epoch) VALUES (1, $1) "
        "ON CONFLICT (id) DO UPDATE SET epoch = GREATEST(fence.epoch, EXCLUDED.epoch)",
        epoch,
    )


async def save_facts(conn: asyncpg.Connection, facts: Iterable[JobFacts]) -> None:
    """Merge facts into the store the way JobFacts.merge does (in job id order, so two
    instances writing overlapping jobs lock rows in the same order)."""
    rows = sorted(facts, key=lambda f: f.job_id)
    if not rows:
        return
    await conn.execute(
        "INSERT INTO preemptor.jobs AS j (job_id, started_attempt, started_at, ended_attempt, "
        "finished, closed, placed_at, preemptible) "
        "SELECT * FROM unnest($1::text[], $2::int[], $3::timestamptz[], $4::int[], "
        "$5::boolean[], $6::boolean[], $7::timestamptz[], $8::boolean[]) "
        "ON CONFLICT (job_id) DO UPDATE SET "
        "started_at = CASE WHEN EXCLUDED.started_attempt > COALESCE(j.started_attempt, -1) "
        "  THEN EXCLUDED.started_at ELSE j.started_at END, "
        "started_attempt = GREATEST(j.started_attempt, EXCLUDED.started_attempt), "
        "ended_attempt = GREATEST(j.ended_attempt, EXCLUDED.ended_attempt), "
        "finished = j.finished OR EXCLUDED.finished, "
        "closed = j.closed OR EXCLUDED.closed, "
        "placed_at = GREATEST(j.placed_at, EXCLUDED.placed_at), "
        "preemptible = COALESCE(EXCLUDED.preemptible, j.preemptible), "
        "updated_at = now()",
        [f.job_id for f in rows],
        [f.started_attempt for f in rows],
        [f.started_at for f in rows],
        [f.ended_attempt for f in rows],
        [f.finished for f in rows],
        [f.closed for f in rows],
        [f.placed_at for f in rows],
        [f.preemptible for f in rows],
    )


async def facts_of(conn: asyncpg.Connection, job_ids: Iterable[str]) -> dict[str, JobFacts]:
    """Facts of these jobs; a job nothing was heard of has empty facts."""
    ids = sorted(set(job_ids))
    rows = await conn.fetch("SELECT * FROM preemptor.jobs WHERE job_id = ANY($1::text[])", ids)
    found = {
        r["job_id"]: JobFacts(
            r["job_id"],
            r["started_attempt"],
            r["started_at"],
            r["ended_attempt"],
            r["finished"],
            r["closed"],
            r["placed_at"],
            r["preemptible"],
        )
        for r in rows
    }
    return {i: found.get(i) or JobFacts(i) for i in ids}


async def has_active(conn: asyncpg.Connection, job_id: str, attempt: int) -> bool:
    return bool(
        await conn.fetchval(
            "SELECT 1 FROM preemptor.preemptions WHERE job_id = $1 AND attempt = $2 "
            "AND state <> 'canceled'",
            job_id,
            attempt,
        )
    )


async def tenant_signals(
    conn: asyncpg.Connection, tenant: str, since: datetime
) -> tuple[datetime, ...]:
    rows = await conn.fetch(
        "SELECT signaled_at FROM preemptor.preemptions WHERE tenant = $1 AND signaled_at > $2",
        tenant,
        since,
    )
    return tuple(r["signaled_at"] for r in rows)


def _lock_key(tenant: str) -> int:
    digest = hashlib.sha256(f"preemptor:budget:{tenant}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


async def lock_tenants(conn: asyncpg.Connection, tenants: Iterable[str]) -> None:
    """Serialise budget checks per tenant across instances until the transaction ends.
    Taken in name order, so two transactions never wait on each other in a cycle."""
    for tenant in sorted(set(tenants)):
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _lock_key(tenant))


async def try_lock_tenant(conn: asyncpg.Connection, tenant: str) -> bool:
    return bool(await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", _lock_key(tenant)))


async def insert(
    conn: asyncpg.Connection,
    got: Incoming,
    state: State,
    now: datetime,
    *,
    hold_until: datetime | None = None,
) -> None:
    r, env = got.request, got.envelope
    await conn.execute(
        "INSERT INTO preemptor.preemptions (id, job_id, attempt, cluster, tenant, for_job, "
        "for_tenant, reason_code, epoch, request, trace_id, requested_at, received_at, state, "
        "hold_until) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, $11, $12, $13, "
        "$14, $15) ON CONFLICT DO NOTHING",  # a request replayed after its id was pruned
        r.id,
        r.job_id,
        r.attempt,
        r.cluster,
        r.tenant,
        r.for_job,
        got.payload.for_tenant,
        r.reason_code,
        r.epoch,
        json.dumps(got.payload.model_dump(mode="json")),
        env.trace_id,
        r.requested_at,
        now,
        state.value,
        hold_until,
    )


async def mark_signaled(
    conn: asyncpg.Connection, pid: str, grace_s: float, stop_at: datetime, now: datetime
) -> None:
    await conn.execute(
        "UPDATE preemptor.preemptions SET state = 'signaled', grace_s = $2, stop_at = $3, "
        "signaled_at = $4, hold_until = NULL WHERE id = $1",
        pid,
        grace_s,
        stop_at,
        now,
    )


async def mark_canceled(
    conn: asyncpg.Connection, pid: str, reason: str, message: str, now: datetime
) -> None:
    await conn.execute(
        "UPDATE preemptor.preemptions SET state = 'canceled', cancel_reason = $2, "
        "cancel_message = $3, canceled_at = $4, hold_until = NULL WHERE id = $1",
        pid,
        reason,
        message,
        now,
    )


async def mark_ordered(conn: asyncpg.Connection, pid: str, now: datetime) -> None:
    await conn.execute(
        "UPDATE preemptor.preemptions SET state = 'ordered', ordered_at = $2 WHERE id = $1",
        pid,
        now,
    )


# What the timer acts on: signaled preemptions whose stop time has come, and held ones.
_DUE = "(state = 'signaled' AND stop_at <= $1) OR state = 'held'"


async def anything_due(pool: asyncpg.Pool, now: datetime) -> bool:
    """Whether any row is due (`claim_due` finds them all but those another instance holds
    locked): one statement outside any transaction. The timer looks every 50 ms and nearly
    always finds nothing; opening a transaction for every look (begin, the locking select,
    commit) cost an idle preemptor about a sixth of its CPU (docs/performance.md)."""
    return bool(
        await pool.fetchval(
            f"SELECT EXISTS (SELECT 1 FROM preemptor.preemptions WHERE {_DUE})", now
        )
    )


async def claim_due(conn: asyncpg.Connection, now: datetime, limit: int) -> list[Tracked]:
    """Signaled preemptions whose stop time has come, and held ones to look at again; locked
    for this transaction and skipped by any other instance's timer meanwhile."""
    rows = await conn.fetch(
        f"SELECT * FROM preemptor.preemptions WHERE {_DUE} "
        "ORDER BY COALESCE(stop_at, hold_until), id LIMIT $2 FOR UPDATE SKIP LOCKED",
        now,
        limit,
    )
    return [_tracked(r) for r in rows]


async def settle_ended(conn: asyncpg.Connection, now: datetime) -> list[tuple[Request, str]]:
    """Ordered preemptions whose victim run has ended by the job facts: done. Covers a run end
    committed while the timer was ordering the stop (the end matched no `ordered` row yet),
    so such a row is neither stuck in `ordered` nor alerted on."""
    rows = await conn.fetch(
        "UPDATE preemptor.preemptions p SET state = 'done', ended_at = $1, ended_by = 'facts' "
        "FROM preemptor.jobs j WHERE p.state = 'ordered' AND j.job_id = p.job_id AND ("
        "  j.closed OR j.ended_attempt >= p.attempt OR j.started_attempt > p.attempt) "
        "RETURNING p.*",
        now,
    )
    return [(_tracked(r).request, r["ended_by"]) for r in rows]


async def claim_unanswered(
    conn: asyncpg.Connection, ordered_before: datetime, now: datetime, limit: int
) -> list[tuple[Request, datetime]]:
    """Stop orders sent before `ordered_before` that no run end has answered and no alert has
    named yet: marked alerted (so one alert per preemption, across instances), returned with
    when each order went out."""
    rows = await conn.fetch(
        "UPDATE preemptor.preemptions SET alerted_at = $2 WHERE id IN ("
        "  SELECT id FROM preemptor.preemptions "
        "  WHERE state = 'ordered' AND alerted_at IS NULL AND ordered_at <= $1 "
        "  ORDER BY ordered_at LIMIT $3 FOR UPDATE SKIP LOCKED) "
        "RETURNING *",
        ordered_before,
        now,
        limit,
    )
    return [(_tracked(r).request, r["ordered_at"]) for r in rows]


async def runs_ended(
    conn: asyncpg.Connection, ends: Sequence[RunEnd], now: datetime
) -> list[tuple[Request, str]]:
    """Ordered preemptions whose victim run has ended are done; returns them with the topic
    that said so. A job.finished without an attempt ends every run of that job."""
    if not ends:
        return []
    rows = await conn.fetch(
        "WITH e AS (SELECT * FROM unnest($1::text[], $2::int[], $3::text[]) "
        "  AS e(job_id, attempt, how)) "
        "UPDATE preemptor.preemptions p SET state = 'done', ended_at = $4, ended_by = sub.how "
        "FROM (SELECT DISTINCT ON (p2.id) p2.id, e.how FROM preemptor.preemptions p2 "
        "  JOIN e ON e.job_id = p2.job_id AND (e.attempt IS NULL OR e.attempt >= p2.attempt) "
        "  WHERE p2.state = 'ordered' ORDER BY p2.id, e.how = 'job.preempted' DESC) sub "
        "WHERE p.id = sub.id RETURNING p.*",
        [e.job_id for e in ends],
        [e.attempt for e in ends],
        [e.how for e in ends],
        now,
    )
    return [(_tracked(r).request, r["ended_by"]) for r in rows]


def _tracked(r: asyncpg.Record) -> Tracked:
    payload = PreemptionRequested.model_validate(json.loads(r["request"]))
    request = to_request(r["id"], r["requested_at"], payload)
    return Tracked(request, State(r["state"]), r["trace_id"], r["received_at"], r["stop_at"])


# --- housekeeping (services.common.housekeeping) -------------------------------------------


# Facts of jobs that finished before the cut-off: no request can name them any more.
prune_job_facts = rows_pruner("preemptor.jobs", "job_id", "finished AND updated_at < $1")
# Finished preemptions (done or canceled) older than the audit retention.
prune_preemptions = rows_pruner(
    "preemptor.preemptions",
    "id",
    "state IN ('done', 'canceled') AND COALESCE(ended_at, canceled_at, received_at) < $1",
)
