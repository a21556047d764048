"""The fleet's nodes as the gateway shows them: each cluster's newest inventory
(cluster.capacity) and each node's health verdicts (node.unhealthy, node.recovered).

Read by the pools consumer, which already follows cluster.capacity: `fleet_writes` turns a batch
into the writes to make (pure), `record_fleet` makes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg
from aiokafka import ConsumerRecord

from schemas import topics
from schemas.events import ClusterCapacity
from schemas.health import NodeRecovered, NodeUnhealthy
from services.common.deadletter import Received, decode_payloads
from services.common.kafka import OutMessage

HEALTH_TOPICS = (topics.NODE_UNHEALTHY, topics.NODE_RECOVERED)
FLEET_TOPICS = (topics.CLUSTER_CAPACITY, *HEALTH_TOPICS)
# An unreadable cluster.capacity record is dead-lettered by pools.record_pools, which reads the
# same records; this module dead-letters only what it alone reads.
_DECODE_DEAD_LETTERS = frozenset(HEALTH_TOPICS)
VERDICTS_KEPT = 20
# The verdicts of a node no inventory lists (gone, or never ours) are forgotten after this.
UNKNOWN_NODE_TTL = timedelta(days=1)
_DETAIL_CHARS = 1000

# An inventory's nodes as one statement: arrays $1-$10 hold the fields that vary by node, in
# the order of an Inventory row less cluster and at ($11, $12: the inventory's own). A node
# whose facts are as stored is left out before the insert (ON CONFLICT would lock its row
# even to leave it), so an unchanged fleet writes nothing and a node's `at` is when its facts
# last changed.
_UPSERT_NODES = """
INSERT INTO gateway.fleet_nodes (node_id, cluster, block, rack, nvlink_domain,
    accelerator_type, generation, accelerators, accelerator_memory_gb, price_tier,
    schedulable, at)
SELECT u.node_id, $11, u.block, u.rack, u.nvlink_domain, u.accelerator_type, u.generation,
    u.accelerators, u.accelerator_memory_gb, u.price_tier, u.schedulable, $12
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
    $7::int[], $8::float8[], $9::text[], $10::bool[])
    AS u(node_id, block, rack, nvlink_domain, accelerator_type, generation, accelerators,
        accelerator_memory_gb, price_tier, schedulable)
LEFT JOIN gateway.fleet_nodes f ON f.node_id = u.node_id
WHERE f.node_id IS NULL
    OR (f.cluster, f.block, f.rack, f.nvlink_domain, f.accelerator_type, f.generation,
        f.accelerators, f.accelerator_memory_gb, f.price_tier, f.schedulable)
    IS DISTINCT FROM ($11, u.block, u.rack, u.nvlink_domain, u.accelerator_type,
        u.generation, u.accelerators, u.accelerator_memory_gb, u.price_tier, u.schedulable)
ON CONFLICT (node_id) DO UPDATE SET cluster = EXCLUDED.cluster, block = EXCLUDED.block,
    rack = EXCLUDED.rack, nvlink_domain = EXCLUDED.nvlink_domain,
    accelerator_type = EXCLUDED.accelerator_type, generation = EXCLUDED.generation,
    accelerators = EXCLUDED.accelerators, accelerator_memory_gb = EXCLUDED.accelerator_memory_gb,
    price_tier = EXCLUDED.price_tier, schedulable = EXCLUDED.schedulable, at = EXCLUDED.at
"""


@dataclass(frozen=True)
class Inventory:
    cluster: str
    location: str
    kind: str
    at: datetime
    nodes: tuple[tuple[Any, ...], ...]  # fleet_nodes rows


@dataclass(frozen=True)
class Verdict:
    event_id: str
    node_id: str
    cluster: str
    quarantined: bool
    cause: str
    incident_id: str
    since: datetime
    detail: str
    at: datetime

    def order(self) -> tuple[datetime, bool]:
        # At the same instant a recovery wins: it can only follow the quarantine it ends.
        return (self.at, not self.quarantined)


@dataclass
class FleetWrites:
    inventories: dict[str, Inventory] = field(default_factory=dict)  # the newest per cluster
    verdicts: list[Verdict] = field(default_factory=list)
    dead: list[OutMessage] = field(default_factory=list)

    @property
    def health(self) -> list[Verdict]:
        """The newest verdict per node in this batch: the one that decides its state."""
        newest: dict[str, Verdict] = {}
        for v in self.verdicts:
            if v.node_id not in newest or v.order() >= newest[v.node_id].order():
                newest[v.node_id] = v
        return [newest[n] for n in sorted(newest)]


def _inventory(got: Received, p: ClusterCapacity) -> Inventory:
    """The cluster's inventory as rows (a node's accelerators are bounded by the wire:
    NodeInfo refuses fewer than 0 or more than 4,096, so such an inventory never gets here)."""
    rows: dict[str, tuple[Any, ...]] = {}
    at = got.envelope.occurred_at
    for n in p.nodes:
        rows[n.node_id] = (
            n.node_id,
            p.cluster,
            n.block,
            n.rack,
            n.nvlink_domain,
            n.accelerator_type,
            n.generation,
            n.accelerators,
            n.accelerator_memory_gb,
            n.price_tier,
            n.healthy,
            at,
        )
    nodes = tuple(rows[k] for k in sorted(rows))
    return Inventory(p.cluster, p.location, p.kind, at, nodes)


def _verdict(got: Received, p: NodeUnhealthy | NodeRecovered) -> Verdict:
    env = got.envelope
    if isinstance(p, NodeUnhealthy):
        detail = "; ".join(p.signals) or p.cause
        return Verdict(
            env.event_id, p.node_id, p.cluster, True, p.cause, p.incident_id, p.since,
            detail[:_DETAIL_CHARS], env.occurred_at,
        )  # fmt: skip
    detail = f"recovered after {p.signals_seen} bad signal(s) since {p.unhealthy_since:%F %T}"
    return Verdict(
        env.event_id, p.node_id, p.cluster, False, p.cause, p.incident_id, p.recovered_at,
        detail, env.occurred_at,
    )  # fmt: skip


def fleet_writes(records: Sequence[ConsumerRecord[Any, Any]]) -> FleetWrites:
    """What a batch changes in the fleet tables; records of other topics are left alone."""
    mine = tuple(r for r in records if r.topic in FLEET_TOPICS)
    received, dead = decode_payloads(
        mine,
        {
            topics.CLUSTER_CAPACITY: ClusterCapacity,
            topics.NODE_UNHEALTHY: NodeUnhealthy,
            topics.NODE_RECOVERED: NodeRecovered,
        },
        consumer="gateway",
    )
    out = FleetWrites(dead=[d for d in dead if d.key in _DECODE_DEAD_LETTERS])
    for got, p in received:
        if isinstance(p, ClusterCapacity):
            inv = _inventory(got, p)
            known = out.inventories.get(inv.cluster)
            if known is None or known.at <= inv.at:
                out.inventories[inv.cluster] = inv
        else:
            out.verdicts.append(_verdict(got, p))
    return out


async def record_fleet(
    pool: asyncpg.Pool, records: Sequence[ConsumerRecord[Any, Any]]
) -> list[OutMessage]:
    """Apply a batch to the fleet tables; returns the dead letters owed for it."""
    writes = fleet_writes(records)
    if not writes.inventories and not writes.verdicts:
        return writes.dead
    async with pool.acquire() as conn, conn.transaction():
        for inv in writes.inventories.values():
            await _replace_inventory(conn, inv)
        if writes.verdicts:
            await _record_verdicts(conn, writes)
        if writes.inventories:
            newest = max(inv.at for inv in writes.inventories.values())
            await _forget_unknown_nodes(conn, newest - UNKNOWN_NODE_TTL)
    return writes.dead


async def _replace_inventory(conn: asyncpg.Connection, inv: Inventory) -> None:
    # A replayed or late inventory must not roll the cluster back.
    applied = await conn.fetchval(
        "INSERT INTO gateway.fleet_clusters (cluster, location, kind, nodes, at)"
        " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (cluster) DO UPDATE SET"
        " location = EXCLUDED.location, kind = EXCLUDED.kind, nodes = EXCLUDED.nodes,"
        " at = EXCLUDED.at WHERE gateway.fleet_clusters.at <= EXCLUDED.at RETURNING true",
        inv.cluster,
        inv.location,
        inv.kind,
        len(inv.nodes),
        inv.at,
    )
    if not applied:
        return
    # One statement each, whatever the inventory's size (PostgreSQL hashes the ids for `ALL`).
    await conn.execute(
        "DELETE FROM gateway.fleet_nodes WHERE cluster = $1 AND node_id <> ALL($2::text[])",
        inv.cluster,
        [row[0] for row in inv.nodes],
    )
    if inv.nodes:
        columns = list(zip(*inv.nodes, strict=True))
        varying = [c for i, c in enumerate(columns) if i not in (1, 11)]  # less cluster, at
        await conn.execute(_UPSERT_NODES, *varying, inv.cluster, inv.at)


async def _record_verdicts(conn: asyncpg.Connection, writes: FleetWrites) -> None:
    await conn.executemany(
        "INSERT INTO gateway.node_verdicts (event_id, node_id, cluster, verdict, cause,"
        " incident_id, detail, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
        " ON CONFLICT (event_id) DO NOTHING",
        [
            (
                v.event_id,
                v.node_id,
                v.cluster,
                "unhealthy" if v.quarantined else "recovered",
                v.cause,
                v.incident_id,
                v.detail,
                v.at,
            )
            for v in writes.verdicts
        ],
    )
    await conn.executemany(
        "INSERT INTO gateway.node_health (node_id, cluster, quarantined, cause, incident_id,"
        " since, at) VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (node_id) DO UPDATE SET"
        " cluster = EXCLUDED.cluster, quarantined = EXCLUDED.quarantined,"
        " cause = EXCLUDED.cause, incident_id = EXCLUDED.incident_id, since = EXCLUDED.since,"
        " at = EXCLUDED.at WHERE gateway.node_health.at < EXCLUDED.at"
        " OR (gateway.node_health.at = EXCLUDED.at AND NOT EXCLUDED.quarantined)",
        [
            (v.node_id, v.cluster, v.quarantined, v.cause, v.incident_id, v.since, v.at)
            for v in writes.health
        ],
    )
    await conn.execute(
        "DELETE FROM gateway.node_verdicts d USING (SELECT event_id, row_number() OVER"
        " (PARTITION BY node_id ORDER BY at DESC, event_id DESC) AS n"
        " FROM gateway.node_verdicts WHERE node_id = ANY($1::text[])) old"
        " WHERE d.event_id = old.event_id AND old.n > $2",
        sorted({v.node_id for v in writes.verdicts}),
        VERDICTS_KEPT,
    )


async def _forget_unknown_nodes(conn: asyncpg.Connection, before: datetime) -> None:
    """Verdicts about nodes no inventory lists stay a while (the inventory naming them may come
    later), then go: a stream of made-up node ids must not grow the tables for ever.

    A node with verdicts has a node_health row as new as its newest verdict (both are written
    together), so the nodes to forget are found among node_health's rows, one per node, and
    their verdicts by node; node_verdicts, some twenty rows a node, is not scanned."""
    await conn.execute(
        "WITH gone AS (DELETE FROM gateway.node_health h WHERE h.at < $1 AND NOT EXISTS"
        " (SELECT 1 FROM gateway.fleet_nodes n WHERE n.node_id = h.node_id) RETURNING node_id)"
        " DELETE FROM gateway.node_verdicts v USING gone WHERE v.node_id = gone.node_id",
        before,
    )
