"""What each node of this cluster has free, down to the device, and the over-commit guard.

The executor is the last line of defence: whatever the scheduler believed, a placement that
would put more on a node than it has is refused here with the numbers. Devices are counted in
thousandths (`core.capacity.MILLI`), exactly as the scheduler counts them, and a replica that
names its devices is booked on exactly those.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from core.capacity import MILLI, milli
from core.model import Node
from schemas.events import ReplicaAssignment

EPS = 1e-9


@dataclass
class NodeUse:
    node: Node
    devices: list[int] = field(default_factory=list)  # free thousandths per device
    cpu: float = 0.0
    memory_gb: float = 0.0

    def __post_init__(self) -> None:
        if not self.devices:
            self.devices = [MILLI] * self.node.accelerators

    @property
    def allocated_accelerators(self) -> float:
        return sum(MILLI - d for d in self.devices) / MILLI


def _take_devices(
    devices: list[int], want: float, named: list[int] | None = None, limit: int | None = None
) -> list[tuple[int, int]] | str:
    """Which devices a replica of `want` accelerators uses, as (index, thousandths); or why
    it cannot fit. Named devices must have the room themselves. Only the first `limit`
    devices are the node's now (a device it stopped offering may stay booked past them)."""
    if want <= 0:
        return []
    limit = len(devices) if limit is None else min(limit, len(devices))
    if named and any(d >= limit for d in named):
        return f"device(s) {[d for d in named if d >= limit]} are not on the node ({limit})"
    if want >= 1:
        count = round(want)
        if named:
            short = [d for d in named if devices[d] < MILLI]
            if short:
                return f"device(s) {short} are not free"
            return [(d, MILLI) for d in named]
        whole = [i for i, free in enumerate(devices[:limit]) if free >= MILLI]
        if len(whole) < count:
            return f"{len(whole)} whole devices free"
        return [(i, MILLI) for i in whole[:count]]
    m = milli(want)
    if named:
        d = named[0]
        if devices[d] < m:
            return f"device {d} has {devices[d] / MILLI:g} free"
        return [(d, m)]
    # A fraction goes to the fullest device it still fits on, keeping whole devices whole.
    fits = [(free, i) for i, free in enumerate(devices[:limit]) if free >= m]
    if not fits:
        return (
            f"no device with {m / MILLI:g} free (the most is {max(devices, default=0) / MILLI:g})"
        )
    _, best = min(fits)
    return [(best, m)]


class NodeBook:
    def __init__(self, nodes: dict[str, Node]) -> None:
        self.use = {node_id: NodeUse(node) for node_id, node in nodes.items()}
        self.by_job: dict[str, list[tuple[str, list[tuple[int, int]], float, float]]] = {}
        # Thousandths booked over all nodes, kept as bookings come and go: the gauge of
        # accelerators in use is set after every batch, and summing every node's devices
        # for it cost what the cluster's size does.
        self.booked_milli = 0

    @property
    def allocated_accelerators(self) -> float:
        """Accelerators booked over the whole cluster."""
        return self.booked_milli / MILLI

    def check(self, replicas: list[ReplicaAssignment], *, new: bool = True) -> str | None:
        """Why this gang cannot be honoured on these nodes, or None if it can. A gang that
        already runs (`new=False`, restored after a restart) is booked even on a node that has
        since turned unhealthy: its devices are taken until it is handed back."""
        # The gang's own nodes only, copied as it reaches them: a copy of every node's books
        # made a check cost what the cluster's size does (1.9 ms at 5,000 nodes).
        trial: dict[str, list[int]] = {}
        extra_cpu: dict[str, float] = {}
        extra_mem: dict[str, float] = {}
        for r in replicas:
            use = self.use.get(r.node_id)
            if use is None:
                return f"node {r.node_id} is not in this cluster"
            if new and not use.node.healthy:
                return f"node {r.node_id} is unhealthy"
            devices = trial.get(r.node_id)
            if devices is None:
                devices = trial[r.node_id] = list(use.devices)
            taken = _take_devices(devices, r.accelerators, r.devices, use.node.accelerators)
            if isinstance(taken, str):
                free = sum(1 for d in devices if d >= MILLI)
                return (
                    f"node {r.node_id} has {free} whole {use.node.accelerator.type} free of "
                    f"{use.node.accelerators}; replica {r.replica} asks for {r.accelerators:g}"
                    f"{' on ' + str(r.devices) if r.devices else ''}: {taken}"
                )
            for i, amount in taken:
                devices[i] -= amount
            extra_cpu[r.node_id] = extra_cpu.get(r.node_id, 0.0) + r.cpu
            extra_mem[r.node_id] = extra_mem.get(r.node_id, 0.0) + r.memory_gb
            if use.cpu + extra_cpu[r.node_id] > use.node.cpu + EPS:
                return (
                    f"node {r.node_id} has {use.node.cpu - use.cpu:g} CPU free; "
                    f"placement asks for {extra_cpu[r.node_id]:g}"
                )
            if use.memory_gb + extra_mem[r.node_id] > use.node.memory_gb + EPS:
                return (
                    f"node {r.node_id} has {use.node.memory_gb - use.memory_gb:g} GB memory "
                    f"free; placement asks for {extra_mem[r.node_id]:g}"
                )
        return None

    def allocate(self, job_id: str, replicas: list[ReplicaAssignment]) -> None:
        """Bind a gang whose `check` passed."""
        held = []
        for r in replicas:
            use = self.use[r.node_id]
            taken = _take_devices(use.devices, r.accelerators, r.devices, use.node.accelerators)
            assert not isinstance(taken, str), "allocate() after a failed check()"
            for i, amount in taken:
                use.devices[i] -= amount
                self.booked_milli += amount
            use.cpu += r.cpu
            use.memory_gb += r.memory_gb
            held.append((r.node_id, taken, r.cpu, r.memory_gb))
        self.by_job[job_id] = held

    def release(self, job_id: str) -> bool:
        held = self.by_job.pop(job_id, None)
        if held is None:
            return False
        for node_id, taken, cpu, mem in held:
            use = self.use[node_id]
            for i, amount in taken:
                before = use.devices[i]
                use.devices[i] = min(MILLI, before + amount)
                self.booked_milli -= use.devices[i] - before
            use.cpu -= cpu
            use.memory_gb -= mem
        return True

    def upsert(self, node: Node) -> None:
        """A node as its cluster reports it now (the kubernetes backend's inventory): what is
        booked on it stays booked; devices it no longer offers go from the end while free
        (bookings name devices by index, so a booked one stays until released)."""
        use = self.use.get(node.node_id)
        if use is None:
            self.use[node.node_id] = NodeUse(node)
            return
        devices = list(use.devices)
        while len(devices) > node.accelerators and devices[-1] >= MILLI:
            devices.pop()
        use.devices = devices + [MILLI] * (node.accelerators - len(devices))
        use.node = node

    def remove(self, node_id: str) -> bool:
        """Forget a node nothing is booked on (an elastic pool's node going away)."""
        use = self.use.get(node_id)
        if use is None or self.busy(node_id):
            return False
        del self.use[node_id]
        return True

    def busy(self, node_id: str) -> bool:
        """Whether anything is booked on the node (accelerators, CPU or memory)."""
        use = self.use.get(node_id)
        if use is None:
            return False
        return self.used(node_id) > EPS or use.cpu > EPS or use.memory_gb > EPS

    def used(self, node_id: str) -> float:
        """Accelerators booked on the node (0 for a node not here)."""
        use = self.use.get(node_id)
        return use.allocated_accelerators if use is not None else 0.0

    def set_health(self, node_id: str, *, healthy: bool) -> bool:
        """Mark a node (un)healthy; False if it is not ours or nothing changed."""
        use = self.use.get(node_id)
        if use is None or use.node.healthy == healthy:
            return False
        use.node = replace(use.node, healthy=healthy)
        return True

    def audit(self) -> list[str]:
        """Every node whose books show more allocated than it has (must always be empty)."""
        bad = []
        for node_id, use in self.use.items():
            if (
                any(d < 0 for d in use.devices)
                or use.cpu > use.node.cpu + EPS
                or use.memory_gb > use.node.memory_gb + EPS
            ):
                bad.append(node_id)
        return bad
