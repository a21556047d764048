"""The ledger on a real PostgreSQL: a tick is written once whatever replays it, and the fast
COPY path falls back to skipping known ticks without losing the new ones beside them."""

from __future__ import annotations

import uuid
from dataclasses import replace

from services.common.db import create_pool
from services.meter import store
from services.meter.runs import Phase, Placement, RunState
from services.meter.ticks import MICRO, Share, close_run
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


async def test_runs_saved_in_one_statement_read_back_as_they_were(
    fresh_database_url: str,
) -> None:
    """`save_runs` writes a batch of runs in one statement (each run's nodes as a JSON array):
    every field reads back as it was, a run with no nodes and one with several alike, and a
    second save of the same runs updates them in place."""
    pool = await create_pool(fresh_database_url)
    g = grid(60, 600)
    share = (Share("reserved", 8 * MICRO, 2 * MICRO),)
    placement = Placement(
        3, "vision", "detect", "ada", "onprem-h100", "H100", ("n-1", "n-2"), share
    )
    states = [
        RunState("job-b", 1),  # a placement still missing: nothing but its key
        RunState(
            "job-a",
            2,
            Phase.OPEN,
            (placement,),
            T0,
            ("n-1", "n-2", "n,3"),
            None,
            None,
            run(start=T0, g=g, job_id="job-a", attempt="2"),
        ),
        RunState("job-a", 1, Phase.CLOSED, (placement,), T0, (), 42 * MICRO, "succeeded"),
    ]
    try:
        await store.migrate_meter(pool)
        async with pool.acquire() as conn, conn.transaction():
            await store.save_runs(conn, states)
        async with pool.acquire() as conn, conn.transaction():
            first = await store.lock_runs(conn, [s.key for s in states])
        moved = replace(states[0], phase=Phase.CLOSED, outcome="canceled")
        async with pool.acquire() as conn, conn.transaction():
            await store.save_runs(conn, [moved])
        async with pool.acquire() as conn, conn.transaction():
            again = await store.lock_runs(conn, [moved.key])
    finally:
        await pool.close()
    assert first == {s.key: s for s in states}
    assert again == {moved.key: moved}
