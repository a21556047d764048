"""Fault injection on the simulated fleet, for demos and tests: a hardware signal from one node
(published on `node.probe` as the node's own agent would) or a whole cluster going dark (its
heartbeats stop). Operator-facing HTTP on the executor's own port, used by `qm fault`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fastapi import APIRouter, HTTPException
from faststream.kafka import KafkaBroker
from pydantic import BaseModel, Field

from schemas import topics
from schemas.health import NodeProbe, SignalKind
from services.common.kafka import OutMessage, envelope_for, publish_all


class ClusterState(StrEnum):
    DOWN = "down"
    UP = "up"


class NodeFault(BaseModel):
    node_id: str
    kind: SignalKind = SignalKind.GPU_XID
    xid: int | None = Field(default=79, description="XID code for gpu_xid (79: fell off the bus)")
    device: int | None = 0


class ClusterFault(BaseModel):
    state: ClusterState


@dataclass
class Outage:
    """While `dark`, the executor sends no heartbeats and no inventory."""

    dark: bool = False


def fault_router(
    cluster: str, node_ids: set[str], broker: KafkaBroker, outage: Outage
) -> APIRouter:
    router = APIRouter(prefix="/faults", tags=["faults"])
    producer = f"executor/{cluster}"

    @router.post("/node", status_code=202)
    async def node_fault(fault: NodeFault) -> dict[str, str]:
        if fault.node_id not in node_ids:
            raise HTTPException(404, detail=f"node {fault.node_id} is not in cluster {cluster}")
        probe = NodeProbe(
            node_id=fault.node_id,
            cluster=cluster,
            kind=fault.kind,
            xid=fault.xid if fault.kind is SignalKind.GPU_XID else None,
            device=fault.device,
            detail="injected by an operator",
        )
        env = envelope_for("NodeProbe", probe, producer=producer)
        await publish_all(broker, [OutMessage(topics.NODE_PROBE, fault.node_id, env)])
        return {"node_id": fault.node_id, "probe": env.event_id}

    @router.post("/cluster", status_code=202)
    async def cluster_fault(fault: ClusterFault) -> dict[str, str]:
        outage.dark = fault.state is ClusterState.DOWN
        return {"cluster": cluster, "state": fault.state.value}

    return router
