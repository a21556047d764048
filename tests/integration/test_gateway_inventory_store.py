"""The gateway's fleet tables on a real PostgreSQL: an inventory replaces its cluster's nodes
in one statement and writes only the nodes whose facts changed; verdicts about nodes no
inventory lists are forgotten a day after the newest of them, and nothing else is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from services.common.db import create_pool, migrate
from services.gateway.inventory import (
    UNKNOWN_NODE_TTL,
    Inventory,
    _forget_unknown_nodes,
    _replace_inventory,
)
from services.gateway.store import MIGRATIONS, SCHEMA

pytestmark = pytest.mark.integration

T0 = datetime(2026, 11, 1, tzinfo=UTC)


@pytest.fixture
async def pool(fresh_database_url: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await create_pool(fresh_database_url)
    await migrate(pool, SCHEMA, MIGRATIONS)
    try:
        yield pool
    finally:
        await pool.close()


def row(node_id: str, at: datetime, cluster: str = "c1", **over: Any) -> tuple[Any, ...]:
    facts = {
        "block": "b0",
        "rack": "r0",
        "nvlink_domain": f"d-{node_id}",
        "accelerator_type": "H100",
        "generation": "hopper",
        "accelerators": 8,
        "accelerator_memory_gb": 80.0,
        "price_tier": "on_demand",
        "schedulable": True,
        **over,
    }
    return (
        node_id, cluster, facts["block"], facts["rack"], facts["nvlink_domain"],
        facts["accelerator_type"], facts["generation"], facts["accelerators"],
        facts["accelerator_memory_gb"], facts["price_tier"], facts["schedulable"], at,
    )  # fmt: skip


def inventory(at: datetime, *rows: tuple[Any, ...], cluster: str = "c1") -> Inventory:
    return Inventory(cluster, "dc", "onprem", at, tuple(sorted(rows)))


async def stored(pool: asyncpg.Pool) -> dict[str, tuple[Any, ...]]:
    """Each node's row as an Inventory row, with its row version (xmin) last."""
    got = await pool.fetch(
        "SELECT node_id, cluster, block, rack, nvlink_domain, accelerator_type, generation,"
        " accelerators, accelerator_memory_gb, price_tier, schedulable, at, xmin::text AS v"
        " FROM gateway.fleet_nodes"
    )
    return {r["node_id"]: tuple(r) for r in got}


async def replace(pool: asyncpg.Pool, inv: Inventory) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await _replace_inventory(conn, inv)


async def test_an_inventory_writes_only_the_nodes_that_changed(pool: asyncpg.Pool) -> None:
    t1, t2 = T0, T0 + timedelta(seconds=30)
    first = [row(f"n{i}", t1) for i in range(6)]
    await replace(pool, inventory(t1, *first))
    before = await stored(pool)
    assert {k: v[:-1] for k, v in before.items()} == {r[0]: r for r in first}

    # n0 cordoned, n1 moved rack, n2 re-priced, n3 and n4 as they were, n5 gone, n6 new.
    second = [
        row("n0", t2, schedulable=False),
        row("n1", t2, rack="r9"),
        row("n2", t2, price_tier="spot"),
        row("n3", t2),
        row("n4", t2),
        row("n6", t2, accelerator_memory_gb=141.0),
    ]
    await replace(pool, inventory(t2, *second))
    after = await stored(pool)
    assert sorted(after) == ["n0", "n1", "n2", "n3", "n4", "n6"]
    for r in second:
        changed = r[0] in ("n0", "n1", "n2", "n6")
        # A changed node carries this inventory's facts and time; an unchanged one is the row
        # that was there (same version: not even locked), its time when its facts last changed.
        assert after[r[0]][:-1] == (r if changed else (*r[:-1], t1))
        if not changed:
            assert after[r[0]][-1] == before[r[0]][-1]

    # The same inventory again, later: no row written.
    await replace(pool, inventory(t2 + timedelta(seconds=30), *second))
    assert await stored(pool) == after


async def test_an_inventory_touches_no_other_cluster_and_an_old_one_is_refused(
    pool: asyncpg.Pool,
) -> None:
    await replace(pool, inventory(T0, row("a1", T0, cluster="a"), cluster="a"))
    await replace(pool, inventory(T0, row("b1", T0, cluster="b"), cluster="b"))
    await replace(pool, inventory(T0 + timedelta(seconds=1), cluster="a"))  # a is now empty
    assert sorted(await stored(pool)) == ["b1"]
    # An older inventory of b (replayed or late) does not roll it back.
    await replace(pool, inventory(T0 - timedelta(seconds=1), cluster="b"))
    assert sorted(await stored(pool)) == ["b1"]
    # A node that moved to another cluster is taken over by that cluster's inventory.
    later = T0 + timedelta(seconds=2)
    await replace(pool, inventory(later, row("b1", later, cluster="a"), cluster="a"))
    assert (await stored(pool))["b1"][1] == "a"


async def verdict(pool: asyncpg.Pool, node_id: str, at: datetime, n: int) -> None:
    await pool.execute(
        "INSERT INTO gateway.node_verdicts (event_id, node_id, cluster, verdict, cause,"
        " incident_id, detail, at) VALUES ($1, $2, 'c1', 'unhealthy', 'xid', 'i', '', $3)",
        f"{node_id}-{n}",
        node_id,
        at,
    )
    await pool.execute(
        "INSERT INTO gateway.node_health (node_id, cluster, quarantined, cause, incident_id,"
        " since, at) VALUES ($1, 'c1', true, 'xid', 'i', $2, $2) ON CONFLICT (node_id)"
        " DO UPDATE SET at = GREATEST(gateway.node_health.at, EXCLUDED.at)",
        node_id,
        at,
    )


async def test_verdicts_of_unknown_nodes_go_a_day_after_the_newest(pool: asyncpg.Pool) -> None:
    now = T0 + timedelta(days=10)
    old, recent = now - UNKNOWN_NODE_TTL - timedelta(hours=1), now - timedelta(hours=1)
    await replace(pool, inventory(now, row("known", now)))
    for n in range(3):  # a listed node's history stays however old it is
        await verdict(pool, "known", old - timedelta(days=n), n)
    await verdict(pool, "ghost", old - timedelta(days=1), 0)  # unlisted, all old: goes
    await verdict(pool, "ghost", old, 1)
    await verdict(pool, "late", old, 0)  # unlisted, but its newest is recent: stays whole
    await verdict(pool, "late", recent, 1)

    async with pool.acquire() as conn:
        await _forget_unknown_nodes(conn, now - UNKNOWN_NODE_TTL)

    health = {r["node_id"] for r in await pool.fetch("SELECT node_id FROM gateway.node_health")}
    verdicts = sorted(
        r["event_id"] for r in await pool.fetch("SELECT event_id FROM gateway.node_verdicts")
    )
    assert health == {"known", "late"}
    assert verdicts == ["known-0", "known-1", "known-2", "late-0", "late-1"]
