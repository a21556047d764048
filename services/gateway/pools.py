"""Elastic node pools for people: each pool's size (current, provisioning, desired, min, max)
and nodes, the autoscaler's last decisions and why, and the work waiting for capacity by
shape (`GET /v1/pools`, `qm pools`); and, for one job, whether a pool is growing for it."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from typing import Any

import asyncpg
from aiokafka import ConsumerRecord
from fastapi import APIRouter, Depends
from pydantic import BaseModel

from schemas import topics
from schemas.events import AutoscaleDecided, CapacityDemand, ClusterCapacity
from services.common.deadletter import decode_payloads
from services.common.kafka import OutMessage
from services.gateway.auth import Principal
from services.gateway.context import Gateway
from services.gateway.deps import gateway, principal

router = APIRouter(prefix="/v1")
POOL_TOPICS = (topics.CLUSTER_CAPACITY, topics.AUTOSCALE_DECIDED, topics.CAPACITY_DEMAND)
DECISIONS_KEPT = 20


class Decision(BaseModel):
    desired_nodes: int
    remove: list[str]
    jobs: int
    reason: str
    at: datetime


class PoolView(BaseModel):
    cluster: str
    pool: str
    accelerator_type: str
    accelerators_per_node: int
    price_tier: str
    min_nodes: int
    max_nodes: int
    desired_nodes: int
    ready: int
    provisioning: int
    busy: int
    failing: str | None = None
    nodes: list[dict[str, Any]]
    decisions: list[Decision]
    at: datetime


class Shape(BaseModel):
    replicas: int
    accelerators: float
    accelerator_types: list[str]
    jobs: int


class PoolsView(BaseModel):
    pools: list[PoolView]
    # Work the scheduler says waits for capacity alone, by gang shape.
    waiting_for_capacity: list[Shape]
    waiting_jobs: int
    pending_jobs: int
    demand_at: datetime | None = None


async def record_pools(
    pool: asyncpg.Pool, records: tuple[ConsumerRecord[Any, Any], ...]
) -> list[OutMessage]:
    """Keep each pool's newest status, the decisions, and the newest demand; returns dead
    letters for what is none of these."""
    received, dead = decode_payloads(
        records,
        {
            topics.CLUSTER_CAPACITY: ClusterCapacity,
            topics.AUTOSCALE_DECIDED: AutoscaleDecided,
            topics.CAPACITY_DEMAND: CapacityDemand,
        },
        consumer="gateway",
    )
    statuses, decisions, demand = {}, [], None
    for got, p in received:
        at = got.envelope.occurred_at
        if isinstance(p, ClusterCapacity):
            for s in p.pools:
                statuses[(p.cluster, s.pool)] = (p.cluster, s.pool, s.model_dump_json(), at)
        elif isinstance(p, AutoscaleDecided):
            decisions.append(
                (
                    got.envelope.event_id,
                    p.cluster,
                    p.pool,
                    p.desired_nodes,
                    p.remove,
                    p.for_jobs,
                    p.reason,
                    at,
                )
            )
        elif isinstance(p, CapacityDemand):
            demand = (p.model_dump_json(include={"jobs"}), p.pending_jobs, p.truncated, at)
    async with pool.acquire() as conn, conn.transaction():
        if statuses:
            await conn.executemany(
                "INSERT INTO gateway.pools (cluster, pool, status, at) VALUES ($1, $2, $3, $4)"
                " ON CONFLICT (cluster, pool) DO UPDATE SET status = EXCLUDED.status,"
                " at = EXCLUDED.at WHERE gateway.pools.at <= EXCLUDED.at",
                list(statuses.values()),
            )
        if decisions:
            await conn.executemany(
                "INSERT INTO gateway.pool_decisions (event_id, cluster, pool, desired_nodes,"
                " remove, for_jobs, reason, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
                " ON CONFLICT (event_id) DO NOTHING",
                decisions,
            )
            await conn.execute(
                "DELETE FROM gateway.pool_decisions d USING (SELECT event_id, row_number()"
                " OVER (PARTITION BY cluster, pool ORDER BY at DESC) AS n"
                " FROM gateway.pool_decisions) old WHERE d.event_id = old.event_id"
                " AND old.n > $1",
                DECISIONS_KEPT,
            )
        if demand is not None:
            await conn.execute(
                "INSERT INTO gateway.capacity_demand (id, jobs, pending_jobs, truncated, at)"
                " VALUES (1, $1, $2, $3, $4) ON CONFLICT (id) DO UPDATE SET jobs = EXCLUDED.jobs,"
                " pending_jobs = EXCLUDED.pending_jobs, truncated = EXCLUDED.truncated,"
                " at = EXCLUDED.at WHERE gateway.capacity_demand.at <= EXCLUDED.at",
                *demand,
            )
    return dead


@router.get("/pools", response_model=PoolsView)
async def list_pools(
    gw: Gateway = Depends(gateway), who: Principal = Depends(principal)
) -> PoolsView:
    """Every elastic pool of the fleet; the waiting work is counted by shape only (no job ids
    of other tenants)."""
    del who  # any token: pools are the fleet's, not a tenant's
    rows = await gw.pool.fetch("SELECT * FROM gateway.pools ORDER BY cluster, pool")
    recent = await gw.pool.fetch(
        "SELECT cluster, pool, desired_nodes, remove, for_jobs, reason, at"
        " FROM gateway.pool_decisions ORDER BY at DESC"
    )
    by_pool: dict[tuple[str, str], list[Decision]] = {}
    for r in recent:
        by_pool.setdefault((r["cluster"], r["pool"]), []).append(
            Decision(
                desired_nodes=r["desired_nodes"],
                remove=list(r["remove"]),
                jobs=len(r["for_jobs"]),
                reason=r["reason"],
                at=r["at"],
            )
        )
    pools = []
    for r in rows:
        s = json.loads(r["status"])
        nodes = s.get("nodes") or []
        pools.append(
            PoolView(
                cluster=r["cluster"],
                pool=r["pool"],
                accelerator_type=s["accelerator_type"],
                accelerators_per_node=s["accelerators_per_node"],
                price_tier=s["price_tier"],
                min_nodes=s["min_nodes"],
                max_nodes=s["max_nodes"],
                desired_nodes=s["desired_nodes"],
                ready=sum(1 for n in nodes if n["state"] == "ready"),
                provisioning=sum(1 for n in nodes if n["state"] == "provisioning"),
                busy=sum(1 for n in nodes if (n.get("used") or 0) > 0),
                failing=s.get("failing"),
                nodes=nodes,
                decisions=by_pool.get((r["cluster"], r["pool"]), [])[:5],
                at=r["at"],
            )
        )
    demand = await gw.pool.fetchrow("SELECT * FROM gateway.capacity_demand WHERE id = 1")
    shapes: Counter[tuple[int, float, tuple[str, ...]]] = Counter()
    pending = 0
    if demand is not None:
        pending = demand["pending_jobs"]
        for j in json.loads(demand["jobs"]).get("jobs", []):
            shapes[(j["replicas"], j["accelerators"], tuple(j["accelerator_types"]))] += 1
    return PoolsView(
        pools=pools,
        waiting_for_capacity=[
            Shape(replicas=k[0], accelerators=k[1], accelerator_types=list(k[2]), jobs=n)
            for k, n in shapes.most_common()
        ],
        waiting_jobs=sum(shapes.values()),
        pending_jobs=pending,
        demand_at=demand["at"] if demand is not None else None,
    )


async def growing_for(pool: asyncpg.Pool, job_id: str) -> dict[str, Any] | None:
    """The newest decision that grew a pool for this job since it was last queued, if any
    (one for an earlier attempt says nothing about this wait)."""
    row = await pool.fetchrow(
        "SELECT cluster, pool, desired_nodes, reason, at FROM gateway.pool_decisions"
        " WHERE for_jobs @> ARRAY[$1]::text[] AND at >= COALESCE((SELECT max(at)"
        " FROM gateway.job_events WHERE job_id = $1 AND type = 'JobQueued'), '-infinity')"
        " ORDER BY at DESC LIMIT 1",
        job_id,
    )
    return dict(row) if row is not None else None
