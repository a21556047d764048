"""Housekeeping on real PostgreSQL: processed event ids past the broker's retention, job facts
of long-finished jobs and finished preemptions past the audit retention are deleted, in
chunks; everything younger, and everything still live, stays."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
from prometheus_client import CollectorRegistry

from services.common.db import create_pool, migrate
from services.common.housekeeping import Housekeeping, processed_events_pruner
from services.preemptor import store

NOW = datetime(2026, 11, 22, 12, tzinfo=UTC)
DAY = 86400.0


async def test_prunes_what_is_past_its_retention_and_nothing_else(
    fresh_database_url: str,
) -> None:
    pool = await create_pool(fresh_database_url)
    try:
        await migrate(pool, store.SCHEMA, store.MIGRATIONS)
        async with pool.acquire() as conn:
            await seed(conn)
        registry = CollectorRegistry()
        keeper = Housekeeping(
            pool,
            {
                "preemptor.processed_events": (processed_events_pruner("preemptor"), 7 * DAY),
                "preemptor.jobs": (store.prune_job_facts, 30 * DAY),
                "preemptor.preemptions": (store.prune_preemptions, 30 * DAY),
            },
            registry,
            clock=lambda: NOW,
            chunk=7,  # 20 old event ids go in three chunks
        )
        done = await keeper.run_once()
        async with pool.acquire() as conn:
            events = {
                r[0] for r in await conn.fetch("SELECT event_id FROM preemptor.processed_events")
            }
            jobs = {r[0] for r in await conn.fetch("SELECT job_id FROM preemptor.jobs")}
            kept = {r[0] for r in await conn.fetch("SELECT id FROM preemptor.preemptions")}
    finally:
        await pool.close()
    assert done == {
        "preemptor.processed_events": 20,
        "preemptor.jobs": 1,
        "preemptor.preemptions": 2,
    }
    assert events == {"recent"}
    assert jobs == {"finished-lately", "old-but-running"}
    assert kept == {"p-live", "p-recent"}
    assert (
        registry.get_sample_value("qm_rows_pruned_total", {"table": "preemptor.processed_events"})
        == 20
    )


async def seed(conn: asyncpg.Connection) -> None:
    old = NOW - timedelta(days=40)
    await conn.executemany(
        "INSERT INTO preemptor.processed_events (event_id, processed_at) VALUES ($1, $2)",
        [(f"old-{i}", NOW - timedelta(days=8)) for i in range(20)]
        + [("recent", NOW - timedelta(days=6))],
    )
    await conn.executemany(
        "INSERT INTO preemptor.jobs (job_id, finished, updated_at) VALUES ($1, $2, $3)",
        [
            ("finished-long-ago", True, old),
            ("finished-lately", True, NOW - timedelta(days=1)),
            ("old-but-running", False, old),
        ],
    )
    rows = [
        ("p-done-old", "done", old, None),
        ("p-canceled-old", "canceled", None, old),
        ("p-live", "ordered", None, None),
        ("p-recent", "done", NOW - timedelta(days=2), None),
    ]
    for n, (pid, state, ended_at, canceled_at) in enumerate(rows):
        await conn.execute(
            "INSERT INTO preemptor.preemptions (id, job_id, attempt, cluster, tenant, for_job, "
            "for_tenant, reason_code, epoch, request, trace_id, requested_at, received_at, "
            "state, ended_at, canceled_at) VALUES ($1, $2, 1, 'c1', 't', 'f', 't', 'r', 1, "
            "'{}', 'tr', $3, $3, $4, $5, $6)",
            pid,
            f"victim-{n}",
            old,
            state,
            ended_at,
            canceled_at,
        )
