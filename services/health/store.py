"""The health service's PostgreSQL schema `health`: node states, incidents, the straggler
detector's job tracks and SLO breaches (plus the outbox and processed events of
services.common.outbox). Writes are batched upserts."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import asyncpg

from schemas.health import Severity
from services.health.book import Changes, HealthBook, Incident
from services.health.burn import Breach, Decisions, clamp_count
from services.health.machine import NodeHealth, NodeState, Signal
from services.health.pace import NodeWindow, Track

SCHEMA = "health"
MIGRATIONS = Path(__file__).parent / "migrations"


async def load_book(pool: asyncpg.Pool) -> HealthBook:
    """Every node and the open incidents: the whole state the decisions need."""
    async with pool.acquire() as conn:
        nodes = await conn.fetch("SELECT * FROM health.nodes")
        incidents = await conn.fetch("SELECT * FROM health.incidents WHERE closed_at IS NULL")
        tracks = await conn.fetch("SELECT * FROM health.straggler_tracks")
    book = HealthBook()
    for r in nodes:
        book.nodes[r["node_id"]] = NodeHealth(
            node_id=r["node_id"],
            cluster=r["cluster"],
            state=NodeState(r["state"]),
            last_heard=r["last_heard"],
            recent=tuple(
                Signal(s["rule"], datetime.fromisoformat(s["at"]), s["label"])
                for s in json.loads(r["recent"])
            ),
            incident_id=r["incident_id"],
            cause=r["cause"],
            quarantined_at=r["quarantined_at"],
            last_bad_at=r["last_bad_at"],
        )
    for r in incidents:
        book.incidents[r["incident_id"]] = _incident(r)
    for r in tracks:
        book.tracks[r["job_id"]] = _track(r)
    book.recount()  # the counts and indexes of what was filled in
    return book


async def save(conn: asyncpg.Connection, changes: Changes) -> None:
    if changes.dropped:
        await conn.execute(
            "DELETE FROM health.nodes WHERE node_id = ANY($1::text[])", sorted(changes.dropped)
        )
    await _save_nodes(conn, sorted(changes.nodes.values(), key=lambda n: n.node_id))
    await _save_incidents(conn, list(changes.incidents.values()))
    await _save_tracks(conn, changes.tracks)


async def incidents_of(conn: asyncpg.Connection, subject: str) -> list[Incident]:
    rows = await conn.fetch(
        "SELECT * FROM health.incidents WHERE subject = $1 ORDER BY first_seen", subject
    )
    return [_incident(r) for r in rows]


async def _save_nodes(conn: asyncpg.Connection, nodes: list[NodeHealth]) -> None:
    if not nodes:
        return
    await conn.executemany(
        "INSERT INTO health.nodes (node_id, cluster, state, last_heard, recent, incident_id, "
        "cause, quarantined_at, last_bad_at) VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9) "
        "ON CONFLICT (node_id) DO UPDATE SET cluster = EXCLUDED.cluster, "
        "state = EXCLUDED.state, last_heard = EXCLUDED.last_heard, recent = EXCLUDED.recent, "
        "incident_id = EXCLUDED.incident_id, cause = EXCLUDED.cause, "
        "quarantined_at = EXCLUDED.quarantined_at, last_bad_at = EXCLUDED.last_bad_at",
        [
            (
                n.node_id,
                n.cluster,
                n.state.value,
                n.last_heard,
                json.dumps(
                    [{"rule": s.rule, "at": s.at.isoformat(), "label": s.label} for s in n.recent]
                ),
                n.incident_id,
                n.cause,
                n.quarantined_at,
                n.last_bad_at,
            )
            for n in nodes
        ],
    )


async def _save_incidents(conn: asyncpg.Connection, incidents: list[Incident]) -> None:
    if not incidents:
        return
    await conn.executemany(
        "INSERT INTO health.incidents (incident_id, subject, cluster, node_id, cause, severity, "
        "suggested_action, first_seen, last_seen, count, closed_at) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) "
        "ON CONFLICT (incident_id) DO UPDATE SET last_seen = EXCLUDED.last_seen, "
        "count = EXCLUDED.count, closed_at = EXCLUDED.closed_at",
        [
            (
                i.incident_id,
                i.subject,
                i.cluster,
                i.node_id,
                i.cause,
                i.severity.value,
                i.suggested_action,
                i.first_seen,
                i.last_seen,
                i.count,
                i.closed_at,
            )
            for i in incidents
        ],
    )


def _incident(r: asyncpg.Record) -> Incident:
    return Incident(
        incident_id=r["incident_id"],
        subject=r["subject"],
        cluster=r["cluster"],
        node_id=r["node_id"],
        cause=r["cause"],
        severity=Severity(r["severity"]),
        suggested_action=r["suggested_action"],
        first_seen=r["first_seen"],
        last_seen=r["last_seen"],
        count=r["count"],
        closed_at=r["closed_at"],
    )


async def _save_tracks(conn: asyncpg.Connection, tracks: dict[str, Track | None]) -> None:
    gone = sorted(job_id for job_id, t in tracks.items() if t is None)
    kept = [t for _, t in sorted(tracks.items()) if t is not None]
    if gone:
        await conn.execute("DELETE FROM health.straggler_tracks WHERE job_id = ANY($1)", gone)
    if not kept:
        return
    await conn.executemany(
        "INSERT INTO health.straggler_tracks (job_id, attempt, cluster, last_at, nodes) "
        "VALUES ($1, $2, $3, $4, $5::jsonb) ON CONFLICT (job_id) DO UPDATE SET "
        "attempt = EXCLUDED.attempt, cluster = EXCLUDED.cluster, last_at = EXCLUDED.last_at, "
        "nodes = EXCLUDED.nodes",
        [
            (
                t.job_id,
                t.attempt,
                t.cluster,
                t.last_at,
                json.dumps([_window_doc(w) for w in t.nodes]),
            )
            for t in kept
        ],
    )


def _window_doc(w: NodeWindow) -> dict[str, object]:
    return {
        "node_id": w.node_id,
        "last_at": w.last_at.isoformat(),
        "recent": "".join("1" if slow else "0" for slow in w.recent),
        "straggling": w.straggling,
        "replica": w.replica,
        "ratio": w.ratio,
    }


def _track(r: asyncpg.Record) -> Track:
    windows = tuple(
        NodeWindow(
            node_id=d["node_id"],
            last_at=datetime.fromisoformat(d["last_at"]),
            recent=tuple(c == "1" for c in d["recent"]),
            straggling=bool(d["straggling"]),
            replica=int(d["replica"]),
            ratio=float(d["ratio"]),
        )
        for d in json.loads(r["nodes"])
    )
    return Track(r["job_id"], r["attempt"], r["cluster"], r["last_at"], windows)


async def open_breaches(conn: asyncpg.Connection) -> list[Breach]:
    rows = await conn.fetch("SELECT * FROM health.slo_breaches WHERE closed_at IS NULL")
    return [_breach(r) for r in rows]


async def save_breaches(conn: asyncpg.Connection, decisions: Decisions) -> set[str]:
    """Close the ended breaches and open the new ones; returns the ids of those opened (a
    breach of an SLO level that is already open in the store is not opened again)."""
    if decisions.closed:
        await conn.executemany(
            "UPDATE health.slo_breaches SET closed_at = $2 WHERE breach_id = $1",
            [(b.breach_id, b.closed_at) for b in decisions.closed],
        )
    fresh: set[str] = set()
    for b in decisions.opened:
        row = await conn.fetchrow(
            "INSERT INTO health.slo_breaches (breach_id, slo, level, severity, "
            "suggested_action, opened_at, count) VALUES ($1, $2, $3, $4, $5, $6, $7) "
            "ON CONFLICT DO NOTHING RETURNING breach_id",
            b.breach_id,
            b.slo,
            b.level,
            b.severity.value,
            b.suggested_action,
            b.opened_at,
            clamp_count(b.count),  # a bigint column
        )
        if row is not None:
            fresh.add(row["breach_id"])
    return fresh


def _breach(r: asyncpg.Record) -> Breach:
    return Breach(
        breach_id=r["breach_id"],
        slo=r["slo"],
        level=r["level"],
        severity=Severity(r["severity"]),
        suggested_action=r["suggested_action"],
        opened_at=r["opened_at"],
        count=r["count"],
        closed_at=r["closed_at"],
    )
