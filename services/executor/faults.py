"""Fault injection on the simulated fleet, for demos and tests: a hardware signal from one node
(published on `node.probe` as the node's own agent would), a straggler (a node whose replicas
step slower, seen in `job.progress`), a whole cluster going dark (its heartbeats stop), and a
seeded random mode mixing them. Operator-facing HTTP on the executor's own port, used by
`qm fault`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from fastapi import APIRouter, HTTPException
from faststream.kafka import KafkaBroker
from pydantic import BaseModel, Field

from schemas import topics
from schemas.health import NodeProbe, SignalKind
from services.common.kafka import OutMessage, envelope_for, publish_all
from services.executor.random_faults import Fault, FaultKind, RandomFaults, Signal


class ClusterState(StrEnum):
    DOWN = "down"
    UP = "up"


class NodeFault(BaseModel):
    node_id: str
    kind: SignalKind = SignalKind.GPU_XID
    xid: int | None = Field(default=79, description="XID code for gpu_xid (79: fell off the bus)")
    device: int | None = 0


class SlowFault(BaseModel):
    node_id: str
    factor: float = Field(
        ge=1, le=100, description="Replicas on the node step this many times slower; 1 clears."
    )


class RandomMode(BaseModel):
    rate_per_hour: float = Field(
        ge=0, le=100_000, description="Faults per fleet hour for the whole cluster; 0 stops."
    )
    seed: int | None = Field(default=None, description="Same seed, same sequence of faults.")


class ClusterFault(BaseModel):
    state: ClusterState


@dataclass
class Outage:
    """While `dark`, the executor sends no heartbeats, no inventory and no progress."""

    dark: bool = False


@dataclass
class Slowdowns:
    """Straggler factors per node (absent = 1), each for good or until a monotonic deadline."""

    clock: Callable[[], float] = time.monotonic
    _slow: dict[str, tuple[float, float | None]] = field(default_factory=dict)

    def set(self, node_id: str, factor: float, for_wall_s: float | None = None) -> None:
        if factor <= 1.0:
            self._slow.pop(node_id, None)
            return
        until = None if for_wall_s is None else self.clock() + for_wall_s
        self._slow[node_id] = (factor, until)

    def current(self) -> dict[str, float]:
        now = self.clock()
        over = [n for n, (_, until) in self._slow.items() if until is not None and until <= now]
        for node_id in over:
            del self._slow[node_id]
        return {n: f for n, (f, _) in self._slow.items()}


class FaultInjector:
    """Makes faults happen on this cluster's nodes."""

    def __init__(
        self,
        cluster: str,
        nodes: dict[str, int],
        broker: KafkaBroker,
        slowdowns: Slowdowns,
        time_scale: float,
    ) -> None:
        self.cluster = cluster
        self.nodes = nodes  # node id -> accelerators
        self.broker = broker
        self.slowdowns = slowdowns
        self.time_scale = time_scale
        self.producer = f"executor/{cluster}"

    async def probe(self, node_id: str, signals: tuple[Signal, ...], detail: str) -> list[str]:
        """Publish the node's probes, as its own agent would; their event ids."""
        out = []
        for s in signals:
            probe = NodeProbe(
                node_id=node_id,
                cluster=self.cluster,
                kind=s.kind,
                xid=s.xid if s.kind is SignalKind.GPU_XID else None,
                device=s.device,
                detail=detail,
            )
            env = envelope_for("NodeProbe", probe, producer=self.producer)
            out.append(OutMessage(topics.NODE_PROBE, node_id, env))
        await publish_all(self.broker, out)
        return [m.envelope.event_id for m in out]

    async def apply(self, fault: Fault) -> None:
        """One fault of the random mode."""
        if fault.kind is FaultKind.STRAGGLER:
            self.slowdowns.set(fault.node_id, fault.factor, fault.for_s / self.time_scale)
        else:
            await self.probe(fault.node_id, fault.signals, f"random fault ({fault.kind.value})")


def fault_router(injector: FaultInjector, outage: Outage, random_mode: RandomFaults) -> APIRouter:
    router = APIRouter(prefix="/faults", tags=["faults"])
    cluster = injector.cluster

    def known(node_id: str) -> None:
        if node_id not in injector.nodes:
            raise HTTPException(404, detail=f"node {node_id} is not in cluster {cluster}")

    @router.post("/node", status_code=202)
    async def node_fault(fault: NodeFault) -> dict[str, str]:
        known(fault.node_id)
        signal = Signal(fault.kind, fault.xid, fault.device)
        (event_id,) = await injector.probe(fault.node_id, (signal,), "injected by an operator")
        return {"node_id": fault.node_id, "probe": event_id}

    @router.post("/slow", status_code=202)
    async def slow_fault(fault: SlowFault) -> dict[str, object]:
        known(fault.node_id)
        injector.slowdowns.set(fault.node_id, fault.factor)
        return {"node_id": fault.node_id, "factor": fault.factor}

    @router.post("/random", status_code=202)
    async def random_faults(mode: RandomMode) -> dict[str, object]:
        random_mode.configure(mode.rate_per_hour, mode.seed)
        return {"cluster": cluster, "rate_per_hour": mode.rate_per_hour, "seed": mode.seed}

    @router.post("/cluster", status_code=202)
    async def cluster_fault(fault: ClusterFault) -> dict[str, str]:
        outage.dark = fault.state is ClusterState.DOWN
        return {"cluster": cluster, "state": fault.state.value}

    @router.get("")
    async def faults_now() -> dict[str, object]:
        """What is injected right now: slowed nodes, the random mode, a dark cluster."""
        return {
            "cluster": cluster,
            "dark": outage.dark,
            "slow": injector.slowdowns.current(),
            "random": {
                "rate_per_hour": random_mode.rate_per_hour,
                "seed": random_mode.seed,
                "injected": random_mode.injected,
            },
        }

    return router
