"""What a cluster's inventory said about prices survives the meter's restart, on a real
PostgreSQL: a placement read after the restart, before any new inventory, is billed at the
node's announced tier and the announced price, not as an on-demand node of unknown price."""

from __future__ import annotations

from typing import Any

import asyncpg
from prometheus_client import CollectorRegistry

from schemas.events import ClusterCapacity, NodeInfo
from services.common.db import create_pool
from services.common.outbox import OutboxRelay
from services.meter import store
from services.meter.budgets import MeterConfig
from services.meter.handlers import Meter, MeterMetrics
from services.meter.pricing import PriceBook
from services.meter.runs import Capacity
from services.meter.ticks import Share, micros
from tests.unit.meter.builders import grid, placed


class _NoPublisher:
    """The relay is never run here: its rows stay in the outbox."""

    async def publish(self, *_args: Any) -> Any:
        raise AssertionError("nothing is published in this test")


def meter(pool: asyncpg.Pool) -> Meter:
    """A meter as app.py builds it, with a fleet file that prices nothing itself."""
    return Meter(
        pool,
        OutboxRelay(pool, _NoPublisher(), store.SCHEMA),  # type: ignore[arg-type]
        grid(),
        MeterConfig(),
        PriceBook(),
        MeterMetrics(CollectorRegistry()),
        lag_s=0,
        idle_lag_s=0,
        max_ticks_per_pass=1000,
        max_idle_backfill=1,
    )


def node(i: int, tier: str) -> NodeInfo:
    return NodeInfo(
        node_id=f"pool-{i}", block="b", rack="r", nvlink_domain="n", accelerator_type="A100",
        generation="ampere", accelerator_memory_gb=80, relative_speed=1, accelerators=8,
        cpu=64, memory_gb=512, price_tier=tier,
    )  # fmt: skip


def inventory(tier: str) -> ClusterCapacity:
    nodes = [node(i, tier) for i in range(3)]
    prices = {"A100": {"spot": 0.95, "on_demand": 3.2}}
    return ClusterCapacity(cluster="cloud", location="eu", kind="cloud", prices=prices, nodes=nodes)


async def test_a_restarted_meter_prices_placements_as_the_last_inventory_said(
    fresh_database_url: str,
) -> None:
    pool = await create_pool(fresh_database_url)
    try:
        await store.migrate_meter(pool)
        before = meter(pool)
        await before.restore()
        await before._apply([("cap-1", Capacity(inventory("spot")))], [])
        version = await pool.fetchval("SELECT xmin::text FROM meter.announced")
        await before._apply([("cap-2", Capacity(inventory("spot")))], [])  # the same again
        assert await pool.fetchval("SELECT xmin::text FROM meter.announced") == version

        after = meter(pool)  # a new process: its book knows only the (empty) fleet file
        await after.restore()
        job = placed("job-7", nodes={"pool-1": 8}, cluster="cloud", accelerator_type="A100")
        await after._apply([("placed-7", job)], [])

        async with pool.acquire() as conn, conn.transaction():
            (state,) = (await store.lock_runs(conn, [("job-7", 1)])).values()
        assert state.placements[0].shares == (Share("spot", micros(8), micros("0.95")),)
        assert after.book.unpriced == set()
    finally:
        await pool.close()
