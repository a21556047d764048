"""Seeded random faults on one cluster, for chaos runs and demos: now and then a node reports a
critical XID, a burst of transient signals, or turns into a straggler. Which node and which
fault come from one seeded RNG, so the same seed replays the same sequence of faults."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import structlog

from schemas.health import SignalKind

log = structlog.get_logger()

CRITICAL_XID = 79  # fell off the bus: quarantined on the first signal (examples/health.yaml)
TRANSIENT_XID = 13  # graphics engine exception: counted against a threshold (rule xid_other)
# A burst of 2 stays below the example rules' threshold of 3 (noise the health service must
# ride out); a burst of 3 reaches it and quarantines the node.
BURST_SIZES = (2, 3)
# A slowed node steps this many times slower (uniform): well past the 1.5x the example health
# rules call a straggler, so every one of them is seen.
STRAGGLER_FACTORS = (2.0, 4.0)
STRAGGLER_FOR_S = (600.0, 1800.0, 3600.0)  # fleet seconds a straggler stays slow


class FaultKind(StrEnum):
    CRITICAL_XID = "critical_xid"
    TRANSIENT_BURST = "transient_burst"
    STRAGGLER = "straggler"


# How often each kind is drawn, relative to the others.
WEIGHTS: tuple[tuple[FaultKind, float], ...] = (
    (FaultKind.CRITICAL_XID, 0.2),
    (FaultKind.TRANSIENT_BURST, 0.4),
    (FaultKind.STRAGGLER, 0.4),
)


@dataclass(frozen=True)
class Signal:
    kind: SignalKind
    xid: int | None = None
    device: int | None = None


@dataclass(frozen=True)
class Fault:
    """One fault on one node: the probes it sends, or (a straggler) its slowdown factor and
    for how many fleet seconds it lasts."""

    kind: FaultKind
    node_id: str
    signals: tuple[Signal, ...] = ()
    factor: float = 1.0
    for_s: float = 0.0


def choose_fault(rng: random.Random, nodes: Mapping[str, int]) -> Fault:
    """The next fault over these nodes (node id -> accelerators). Pure given the RNG state;
    nodes are taken in id order so the same seed picks the same nodes."""
    if not nodes:
        raise ValueError("no nodes to fault")
    node_id = rng.choice(sorted(nodes))
    kind = rng.choices([k for k, _ in WEIGHTS], weights=[w for _, w in WEIGHTS])[0]
    device = rng.randrange(max(nodes[node_id], 1))
    if kind is FaultKind.CRITICAL_XID:
        return Fault(kind, node_id, (Signal(SignalKind.GPU_XID, CRITICAL_XID, device),))
    if kind is FaultKind.TRANSIENT_BURST:
        signal = rng.choice(
            (
                Signal(SignalKind.THERMAL_THROTTLE, None, device),
                Signal(SignalKind.GPU_XID, TRANSIENT_XID, device),
            )
        )
        return Fault(kind, node_id, (signal,) * rng.choice(BURST_SIZES))
    factor = round(rng.uniform(*STRAGGLER_FACTORS), 2)
    return Fault(kind, node_id, factor=factor, for_s=rng.choice(STRAGGLER_FOR_S))


def next_fault_in_s(rng: random.Random, rate_per_hour: float) -> float:
    """Fleet seconds until the next fault of a Poisson process at this rate."""
    return rng.expovariate(rate_per_hour / 3600.0)


def seeded(seed: int | None, cluster: str) -> random.Random:
    """The RNG of a cluster's fault mode: the cluster's name is mixed in, so one seed given
    to every cluster of a stack does not fault the same node index everywhere at once."""
    return random.Random(f"{seed}/{cluster}") if seed is not None else random.Random()


class RandomFaults:
    """The random fault mode of one cluster. `configure` (re)starts it with a rate (faults per
    fleet hour for the whole cluster; 0 stops it) and a seed; `run_forever` injects."""

    def __init__(
        self,
        cluster: str,
        nodes: Mapping[str, int],
        inject: Callable[[Fault], Awaitable[None]],
        time_scale: float,
    ) -> None:
        self.cluster = cluster
        self.nodes = dict(nodes)
        self.inject = inject
        self.time_scale = time_scale
        self.rate_per_hour = 0.0
        self.seed: int | None = None
        self.injected = 0
        self._rng = random.Random()
        self._changed = asyncio.Event()

    def configure(self, rate_per_hour: float, seed: int | None) -> None:
        self.rate_per_hour = max(rate_per_hour, 0.0)
        self.seed = seed
        self._rng = seeded(seed, self.cluster)
        self._changed.set()
        log.info("random faults", rate_per_hour=self.rate_per_hour, seed=seed)

    async def _wait_changed(self, timeout_s: float | None) -> bool:
        """True if the mode was reconfigured within the timeout."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            return False
        self._changed.clear()
        return True

    async def run_forever(self) -> None:
        while True:
            if self.rate_per_hour <= 0 or not self.nodes:
                await self._wait_changed(None)
                continue
            wall_s = next_fault_in_s(self._rng, self.rate_per_hour) / self.time_scale
            if await self._wait_changed(wall_s):
                continue  # a new rate or seed: start its sequence afresh
            fault = choose_fault(self._rng, self.nodes)
            self.injected += 1
            log.info(
                "random fault",
                kind=fault.kind.value,
                node=fault.node_id,
                signals=len(fault.signals),
                factor=fault.factor,
            )
            await self.inject(fault)
