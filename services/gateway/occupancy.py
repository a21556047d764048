"""Who holds which device of which node, and what that leaves: per-device states, totals by
accelerator type and the gang shapes that could start now. Pure: the fleet routes feed it the
nodes of the inventories and the placements of the jobs holding devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from schemas.job import JobState
from services.gateway.projection import Placement

# Gang shapes (devices per replica) the fragmentation line counts, where a node is that big.
SHAPES = (1, 2, 4, 8)
_EPS = 1e-9


class DeviceState(StrEnum):
    IDLE = "idle"
    ALLOCATED = "allocated"  # a running (or preempting) job uses it
    HELD = "held"  # placed, not started yet: held for its gang
    QUARANTINED = "quarantined"  # the health service took the node out
    CORDONED = "cordoned"  # the executor keeps the node out of scheduling (e.g. an operator)


class NodeState(StrEnum):
    IDLE = "idle"  # every device idle
    PARTIAL = "partial"  # some devices idle, some taken
    ALLOCATED = "allocated"  # no device idle
    QUARANTINED = "quarantined"
    CORDONED = "cordoned"


@dataclass(frozen=True)
class NodeFacts:
    node_id: str
    cluster: str
    block: str
    rack: str
    nvlink_domain: str
    accelerator_type: str
    accelerators: int
    price_tier: str
    schedulable: bool = True
    quarantined: bool = False
    cause: str | None = None  # of the open quarantine


@dataclass(frozen=True)
class Holder:
    """A job whose placement holds devices now."""

    job_id: str
    tenant: str
    state: JobState
    placement: Placement


@dataclass
class DeviceUse:
    index: int
    used: float = 0.0  # of this device, 0 to 1
    holders: list[Holder] = field(default_factory=list)
    state: DeviceState = DeviceState.IDLE


@dataclass
class NodeUse:
    node: NodeFacts
    devices: list[DeviceUse]
    # Replicas that named no devices were put on the lowest free devices: the exact devices
    # are the executor's choice, only the amount is known.
    approximate: bool = False
    holders: list[Holder] = field(default_factory=list)

    @property
    def state(self) -> NodeState:
        if self.node.quarantined:
            return NodeState.QUARANTINED
        if not self.node.schedulable:
            return NodeState.CORDONED
        idle = sum(1 for d in self.devices if d.state is DeviceState.IDLE)
        if idle == len(self.devices):
            return NodeState.IDLE
        return NodeState.PARTIAL if idle else NodeState.ALLOCATED

    @property
    def idle_devices(self) -> int:
        return sum(1 for d in self.devices if d.state is DeviceState.IDLE)


def occupy(nodes: Iterable[NodeFacts], holders: Iterable[Holder]) -> list[NodeUse]:
    """Each node with the use of each device, in the order the nodes came."""
    uses = {n.node_id: NodeUse(n, [DeviceUse(i) for i in range(n.accelerators)]) for n in nodes}
    unnamed: list[tuple[NodeUse, Holder, float]] = []
    for h in holders:
        for r in h.placement.replicas:
            use = uses.get(r.node_id)
            if use is None or use.node.cluster != h.placement.cluster:
                continue  # a node this view does not show (another cluster, or filtered out)
            if h not in use.holders:
                use.holders.append(h)
            if not r.devices:
                unnamed.append((use, h, r.accelerators))
                continue
            share = min(r.accelerators, 1.0)
            for index in r.devices:
                if 0 <= index < len(use.devices):  # an index past the node's end is not shown
                    _take(use.devices[index], h, share)
    for use, h, amount in unnamed:
        use.approximate = True
        _take_lowest(use, h, amount)
    for use in uses.values():
        for d in use.devices:
            d.state = _device_state(use.node, d)
    return list(uses.values())


def _take(device: DeviceUse, h: Holder, share: float) -> None:
    device.used = min(1.0, device.used + share)
    if h not in device.holders:
        device.holders.append(h)


def _take_lowest(use: NodeUse, h: Holder, amount: float) -> None:
    if amount >= 1:
        whole = [d for d in use.devices if d.used <= _EPS][: math.ceil(amount - _EPS)]
        for d in whole:
            _take(d, h, 1.0)
        return
    fitting = [d for d in use.devices if d.used + amount <= 1 + _EPS]
    if fitting:
        _take(fitting[0], h, amount)


def _device_state(node: NodeFacts, d: DeviceUse) -> DeviceState:
    if node.quarantined:
        return DeviceState.QUARANTINED
    if not node.schedulable:
        return DeviceState.CORDONED
    if d.used <= _EPS:
        return DeviceState.IDLE
    if all(h.state is JobState.PLACED for h in d.holders):
        return DeviceState.HELD
    return DeviceState.ALLOCATED


@dataclass
class TypeTotal:
    accelerator_type: str
    total: int = 0
    allocated: int = 0  # devices taken, including held ones
    held: int = 0
    idle: int = 0
    quarantined: int = 0
    cordoned: int = 0
    in_use: float = 0.0  # accelerators in use, fractions counted as such

    @property
    def unhealthy(self) -> int:
        return self.quarantined + self.cordoned


def totals(uses: Sequence[NodeUse]) -> list[TypeTotal]:
    """Devices by accelerator type; each device is exactly one of allocated (held included),
    idle, quarantined or cordoned, so those add up to the total."""
    by_type: dict[str, TypeTotal] = {}
    for use in uses:
        t = by_type.setdefault(use.node.accelerator_type, TypeTotal(use.node.accelerator_type))
        for d in use.devices:
            t.total += 1
            t.in_use += d.used
            if d.state is DeviceState.QUARANTINED:
                t.quarantined += 1
            elif d.state is DeviceState.CORDONED:
                t.cordoned += 1
            elif d.state is DeviceState.IDLE:
                t.idle += 1
            else:
                t.allocated += 1
                t.held += d.state is DeviceState.HELD
    return [by_type[k] for k in sorted(by_type)]


@dataclass(frozen=True)
class Fit:
    """How many replicas of `devices` whole devices of a type could start now."""

    accelerator_type: str
    devices: int
    fits: int  # replicas, each on whole idle devices of one healthy node
    nodes: int  # nodes that take at least one
    by_cluster: dict[str, int]


def fragmentation(uses: Sequence[NodeUse], shapes: Sequence[int] = SHAPES) -> list[Fit]:
    """For each type and each shape no bigger than its biggest node: where it could start now
    on whole idle devices of schedulable, healthy nodes (topology inside a node aside)."""
    by_type: dict[str, list[NodeUse]] = {}
    for use in uses:
        by_type.setdefault(use.node.accelerator_type, []).append(use)
    out: list[Fit] = []
    for accelerator_type in sorted(by_type):
        group = by_type[accelerator_type]
        biggest = max(u.node.accelerators for u in group)
        for k in shapes:
            if k > biggest:
                continue
            by_cluster: dict[str, int] = {}
            nodes = 0
            for u in group:
                n = u.idle_devices // k
                if n:
                    nodes += 1
                    by_cluster[u.node.cluster] = by_cluster.get(u.node.cluster, 0) + n
            out.append(Fit(accelerator_type, k, sum(by_cluster.values()), nodes, by_cluster))
    return out


def visible_jobs(d: DeviceUse, may_read: Callable[[str], bool]) -> list[str]:
    """The ids of the jobs on a device that the caller may read; others stay anonymous."""
    return [h.job_id for h in d.holders if may_read(h.tenant)]
