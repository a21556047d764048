"""The fleet for people: every accelerator grouped by cluster, block, rack and node with its
state, totals by type and where gang shapes could start now (`GET /v1/fleet`); nodes as a flat
list (`GET /v1/nodes`) and one node with its health history and jobs (`GET /v1/nodes/{id}`);
and each tenant's queue (`GET /v1/queues`, built in services/gateway/queues.py).

The building functions are called in-process by the dashboard as well; a caller sees the ids of
jobs on a device only for the tenants it may read, otherwise just that the device is taken.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel

from schemas.job import JobState
from services.gateway.auth import Principal
from services.gateway.context import Gateway
from services.gateway.deps import gateway, principal
from services.gateway.occupancy import (
    DeviceState,
    Holder,
    NodeFacts,
    NodeState,
    NodeUse,
    fragmentation,
    occupy,
    totals,
    visible_jobs,
)
from services.gateway.projection import HOLDING, Placement
from services.gateway.queues import QueuesView, queues_view

router = APIRouter(prefix="/v1")
GatewayDep = Annotated[Gateway, Depends(gateway)]
PrincipalDep = Annotated[Principal, Depends(principal)]


class DeviceCell(BaseModel):
    index: int
    state: DeviceState
    used: float  # of the device, 0 to 1 (fractional jobs share one)
    jobs: list[str]  # the ids the caller may read; an allocated device may list none


class NodeCell(BaseModel):
    node_id: str
    cluster: str
    block: str
    rack: str
    nvlink_domain: str
    accelerator_type: str
    accelerators: int
    price_tier: str
    state: NodeState
    allocated: int
    idle: int
    cause: str | None = None  # why it is quarantined
    # Some replica on it named no devices: its devices are shown on the lowest free ones.
    approximate: bool = False
    devices: list[DeviceCell]


class RackView(BaseModel):
    rack: str
    nodes: list[NodeCell]


class BlockView(BaseModel):
    block: str
    racks: list[RackView]


class ClusterView(BaseModel):
    cluster: str
    location: str
    kind: str
    inventory_at: datetime
    blocks: list[BlockView]


class TypeTotals(BaseModel):
    accelerator_type: str
    total: int
    allocated: int  # held ones included
    held: int
    idle: int
    unhealthy: int  # quarantined + cordoned
    quarantined: int
    cordoned: int
    in_use: float  # accelerators, fractions included


class FragmentationLine(BaseModel):
    accelerator_type: str
    devices: int  # per replica, on one node
    fits: int  # replicas of that size that could start now
    nodes: int
    by_cluster: dict[str, int]


class FleetView(BaseModel):
    clusters: list[ClusterView]
    totals: list[TypeTotals]
    fragmentation: list[FragmentationLine]
    at: datetime


class NodesView(BaseModel):
    nodes: list[NodeCell]


class HealthEntry(BaseModel):
    verdict: str  # unhealthy or recovered
    cause: str
    incident_id: str
    detail: str
    at: datetime


class NodeJob(BaseModel):
    job_id: str | None  # None: another tenant's job, shown only as an allocation
    tenant: str | None
    state: str
    replicas: list[int]
    accelerators: float
    devices: list[int]


class NodeDetail(BaseModel):
    node: NodeCell
    quarantined_since: datetime | None = None
    health: list[HealthEntry]
    jobs: list[NodeJob]


async def _occupancy(
    gw: Gateway, *, cluster: str | None = None, accelerator_type: str | None = None
) -> list[NodeUse]:
    nodes = await gw.pool.fetch(
        "SELECT n.*, COALESCE(h.quarantined, false) AS quarantined, h.cause"
        " FROM gateway.fleet_nodes n LEFT JOIN gateway.node_health h USING (node_id)"
        " WHERE ($1::text IS NULL OR n.cluster = $1) AND ($2::text IS NULL"
        " OR n.accelerator_type = $2) ORDER BY n.cluster, n.block, n.rack, n.node_id",
        cluster,
        accelerator_type,
    )
    jobs = await gw.pool.fetch(
        "SELECT job_id, tenant, state, attempt, placement FROM gateway.jobs"
        " WHERE state = ANY($1::text[]) AND placement IS NOT NULL",
        sorted(s.value for s in HOLDING),
    )
    holders = []
    for j in jobs:
        placement = Placement.from_json(json.loads(j["placement"]))
        if placement.attempt == j["attempt"]:
            holders.append(Holder(j["job_id"], j["tenant"], JobState(j["state"]), placement))
    facts = [
        NodeFacts(
            node_id=n["node_id"],
            cluster=n["cluster"],
            block=n["block"],
            rack=n["rack"],
            nvlink_domain=n["nvlink_domain"],
            accelerator_type=n["accelerator_type"],
            accelerators=n["accelerators"],
            price_tier=n["price_tier"],
            schedulable=n["schedulable"],
            quarantined=n["quarantined"],
            cause=n["cause"] if n["quarantined"] else None,
        )
        for n in nodes
    ]
    return occupy(facts, holders)


def _cell(use: NodeUse, who: Principal) -> NodeCell:
    n = use.node
    return NodeCell(
        node_id=n.node_id,
        cluster=n.cluster,
        block=n.block,
        rack=n.rack,
        nvlink_domain=n.nvlink_domain,
        accelerator_type=n.accelerator_type,
        accelerators=n.accelerators,
        price_tier=n.price_tier,
        state=use.state,
        allocated=sum(1 for d in use.devices if d.used > 0),
        idle=use.idle_devices,
        cause=n.cause,
        approximate=use.approximate,
        devices=[
            DeviceCell(
                index=d.index,
                state=d.state,
                used=round(d.used, 3),
                jobs=visible_jobs(d, who.can_read),
            )
            for d in use.devices
        ],
    )


async def fleet_view(
    gw: Gateway,
    who: Principal,
    *,
    cluster: str | None = None,
    accelerator_type: str | None = None,
    cells: bool = True,
) -> FleetView:
    """Every node of the inventories, grouped cluster -> block -> rack -> node; with
    `cells=False` the totals and fragmentation alone (`clusters` empty)."""
    uses = await _occupancy(gw, cluster=cluster, accelerator_type=accelerator_type)
    inventories = {
        r["cluster"]: r for r in await gw.pool.fetch("SELECT * FROM gateway.fleet_clusters")
    }
    grouped: dict[str, dict[str, dict[str, list[NodeCell]]]] = {}
    for use in uses if cells else ():  # already in cluster, block, rack, node order
        n = use.node
        grouped.setdefault(n.cluster, {}).setdefault(n.block, {}).setdefault(n.rack, []).append(
            _cell(use, who)
        )
    clusters = []
    for name, blocks in grouped.items():
        inv = inventories.get(name)
        clusters.append(
            ClusterView(
                cluster=name,
                location=inv["location"] if inv else "",
                kind=inv["kind"] if inv else "",
                inventory_at=inv["at"] if inv else datetime.now(UTC),
                blocks=[
                    BlockView(
                        block=b,
                        racks=[RackView(rack=r, nodes=cells) for r, cells in racks.items()],
                    )
                    for b, racks in blocks.items()
                ],
            )
        )
    return FleetView(
        clusters=clusters,
        totals=[
            TypeTotals(
                accelerator_type=t.accelerator_type,
                total=t.total,
                allocated=t.allocated,
                held=t.held,
                idle=t.idle,
                unhealthy=t.unhealthy,
                quarantined=t.quarantined,
                cordoned=t.cordoned,
                in_use=round(t.in_use, 3),
            )
            for t in totals(uses)
        ],
        fragmentation=[
            FragmentationLine(
                accelerator_type=f.accelerator_type,
                devices=f.devices,
                fits=f.fits,
                nodes=f.nodes,
                by_cluster=f.by_cluster,
            )
            for f in fragmentation(uses)
        ],
        at=datetime.now(UTC),
    )


async def nodes_view(
    gw: Gateway,
    who: Principal,
    *,
    cluster: str | None = None,
    accelerator_type: str | None = None,
    state: NodeState | None = None,
) -> NodesView:
    """The nodes of the inventories as one list, filtered by cluster, type and node state."""
    uses = await _occupancy(gw, cluster=cluster, accelerator_type=accelerator_type)
    return NodesView(
        nodes=[_cell(u, who) for u in uses if state is None or u.state is state],
    )


async def node_detail(gw: Gateway, who: Principal, node_id: str) -> NodeDetail | None:
    """One node, its newest health verdicts and the jobs on it; None if no inventory has it."""
    row = await gw.pool.fetchrow(
        "SELECT cluster, accelerator_type FROM gateway.fleet_nodes WHERE node_id = $1", node_id
    )
    if row is None:
        return None
    uses = await _occupancy(gw, cluster=row["cluster"], accelerator_type=row["accelerator_type"])
    use = next((u for u in uses if u.node.node_id == node_id), None)
    if use is None:  # the inventory changed between the two reads
        return None
    verdicts = await gw.pool.fetch(
        "SELECT verdict, cause, incident_id, detail, at FROM gateway.node_verdicts"
        " WHERE node_id = $1 ORDER BY at DESC, event_id DESC",
        node_id,
    )
    since = await gw.pool.fetchval(
        "SELECT since FROM gateway.node_health WHERE node_id = $1 AND quarantined", node_id
    )
    jobs = []
    for h in use.holders:
        mine = [r for r in h.placement.replicas if r.node_id == node_id]
        readable = who.can_read(h.tenant)
        jobs.append(
            NodeJob(
                job_id=h.job_id if readable else None,
                tenant=h.tenant if readable else None,
                state=h.state.value,
                replicas=[r.replica for r in mine],
                accelerators=sum(r.accelerators for r in mine),
                devices=sorted({d for r in mine for d in r.devices}),
            )
        )
    return NodeDetail(
        node=_cell(use, who),
        quarantined_since=since,
        health=[HealthEntry(**dict(v)) for v in verdicts],
        jobs=jobs,
    )


@router.get("/fleet", response_model=FleetView)
async def get_fleet(
    gw: GatewayDep,
    who: PrincipalDep,
    cluster: Annotated[str | None, Query()] = None,
    accelerator_type: Annotated[str | None, Query(alias="type")] = None,
    cells: Annotated[
        bool, Query(description="false: totals and fragmentation only, no node cells.")
    ] = True,
) -> FleetView:
    """Every accelerator by cluster, block, rack and node, with totals and fragmentation."""
    return await fleet_view(
        gw, who, cluster=cluster, accelerator_type=accelerator_type, cells=cells
    )


@router.get("/nodes", response_model=NodesView)
async def get_nodes(
    gw: GatewayDep,
    who: PrincipalDep,
    cluster: Annotated[str | None, Query()] = None,
    accelerator_type: Annotated[str | None, Query(alias="type")] = None,
    state: Annotated[NodeState | None, Query()] = None,
) -> NodesView:
    """The fleet's nodes as a flat list (filter by cluster, accelerator type, node state)."""
    return await nodes_view(
        gw, who, cluster=cluster, accelerator_type=accelerator_type, state=state
    )


@router.get("/nodes/{node_id}", response_model=NodeDetail)
async def get_node(node_id: str, gw: GatewayDep, who: PrincipalDep) -> NodeDetail:
    """One node: its devices, its health history (newest first) and the jobs on it."""
    detail = await node_detail(gw, who, node_id)
    if detail is None:
        raise HTTPException(404, detail=f"no node {node_id} in any cluster's inventory")
    return detail


@router.get("/queues", response_model=QueuesView)
async def get_queues(
    gw: GatewayDep,
    who: PrincipalDep,
    hours: Annotated[
        float, Query(gt=0, le=720, description="Window of wait and preemption figures.")
    ] = 24.0,
) -> QueuesView:
    """Each tenant's quota, usage, borrowing, lending, pending work and fairness (a researcher's
    token sees its own tenant)."""
    return await queues_view(gw, who, hours=hours)
