"""The ledger on a real PostgreSQL: a tick is written once whatever replays it, and the fast
COPY path falls back to skipping known ticks without losing the new ones beside them."""

from __future__ import annotations

import uuid

from services.common.db import create_pool
from services.meter import store
from services.meter.ticks import MICRO, close_run
from tests.unit.meter.builders import T0, grid, run


async def test_replayed_ticks_count_once_and_new_ones_beside_them_still_land(
    fresh_database_url: str,
) -> None:
    pool = await create_pool(fresh_database_url)
    try:
        await store.migrate_meter(pool)
        g = grid(60, 600)
        job = f"ledger-{uuid.uuid4().hex[:6]}"
        ticks = close_run(run(start=T0, g=g, job_id=job), 3000 * MICRO, g, "succeeded")
        first, rest = ticks[:30], ticks[30:]
        async with pool.acquire() as conn, conn.transaction():
            assert await store.insert_ticks(conn, first) == first
        async with pool.acquire() as conn, conn.transaction():
            assert await store.insert_ticks(conn, first) == []  # a replay: nothing new
        async with pool.acquire() as conn, conn.transaction():
            assert await store.insert_ticks(conn, ticks) == rest  # old and new mixed
        total = await pool.fetchrow(
            "SELECT count(*) AS n, sum(accelerator_seconds_u) AS s FROM meter.ledger "
            "WHERE job_id = $1",
            job,
        )
        assert (total["n"], total["s"]) == (len(ticks), 8 * 3000 * MICRO)
    finally:
        await pool.close()
