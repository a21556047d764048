"""The fleet's free capacity while decisions are being made: numpy arrays indexed by node, charged
by every placement and credited by every release, so that nothing is ever over-committed.

Devices are counted exactly and one by one: each device of each node has a use in thousandths
of a device (`MILLI`), so 0.1 + 0.2 of a device is 300 and sums never drift. A whole replica
takes untouched devices (lowest index first); a fractional one goes on the fullest device it
still fits on, else on an untouched one. Every placement records the devices it took
(`ReplicaPlacement.devices`), the executor books exactly those, and a state rebuilt from running
work charges them again as they are, so the scheduler's view of each device is the executor's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from core.model import (
    Allocation,
    Cluster,
    ClusterId,
    JobRequest,
    Node,
    NodeId,
    PriceTier,
    ReplicaPlacement,
    TopologyLevel,
)

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

# Tolerance for float comparisons outside device accounting (CPU, memory, scores).
EPS = 1e-9
# Device use is counted in thousandths of a device.
MILLI = 1000


def milli(accelerators: float) -> int:
    """Accelerators in exact units: thousandths of a device, to the nearest (a third is 333,
    so three thirds share a device as asked; a fraction takes at least one)."""
    if accelerators <= 0:
        return 0
    return max(1, round(accelerators * MILLI))


@dataclass
class Capacity:
    nodes: list[Node]
    index: dict[NodeId, int]
    cluster_names: list[ClusterId]
    cluster_of: IntArray
    type_names: list[str]
    type_of: IntArray
    devices: IntArray
    device_memory: FloatArray
    node_cpu: FloatArray
    node_memory: FloatArray
    usable: BoolArray
    spot: BoolArray
    # Price per accelerator-hour divided by relative speed: what useful work costs here.
    effective_cost: FloatArray
    domains: dict[TopologyLevel, IntArray]
    domain_names: dict[TopologyLevel, list[str]]
    # Untouched devices per node, and each device's use in thousandths (MILLI: taken whole;
    # columns past a node's device count are MILLI and never chosen).
    free_whole: IntArray
    device_used: IntArray
    free_cpu: FloatArray
    free_memory: FloatArray
    # Free thousandths per node and per cluster (exact), and the same in accelerators (for
    # scores: computed from the exact figure, so equal nodes are exact ties).
    free_milli: IntArray
    free_total: FloatArray
    cluster_free_milli: IntArray
    cluster_free: FloatArray
    cluster_devices: FloatArray
    # Reservation number holding the node for a waiting gang, or -1.
    held: IntArray
    # Per accelerator type (`type_names` order), in thousandths, on usable nodes only: devices,
    # free room, and what running work restricted to some of the fleet's types holds (placement
    # keeps room of a type for the work that can run nowhere else; `core.placement`).
    type_devices_milli: IntArray
    type_free_milli: IntArray
    type_claimed_milli: IntArray
    _candidates: dict[tuple[object, ...], IntArray] = field(default_factory=dict)
    # Whether a job shape fits an idle fleet (see `core.placement`): static, so cached here.
    empty_fits: dict[tuple[object, ...], bool] = field(default_factory=dict)
    # Spread groups (`JobRequest.spread_group`): node -> replicas of the group running there.
    spread: dict[str, dict[int, int]] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        nodes: Mapping[NodeId, Node],
        clusters: Mapping[ClusterId, Cluster],
        fallback_prices: Mapping[tuple[str, PriceTier], float],
    ) -> Capacity:
        # Sorting by id makes every array position, and so every tie-break, reproducible.
        ordered = [nodes[k] for k in sorted(nodes)]
        cluster_names = sorted({n.cluster for n in ordered})
        type_names = sorted({n.accelerator.type for n in ordered})
        max_devices = max((n.accelerators for n in ordered), default=1)
        domains = {lvl: _domain_codes(ordered, lvl) for lvl in TopologyLevel}
        return cls(
            nodes=ordered,
            index={n.node_id: i for i, n in enumerate(ordered)},
            cluster_names=cluster_names,
            cluster_of=_codes([n.cluster for n in ordered], cluster_names),
            type_names=type_names,
            type_of=_codes([n.accelerator.type for n in ordered], type_names),
            devices=np.array([n.accelerators for n in ordered], dtype=np.int64),
            device_memory=np.array([n.accelerator.memory_gb for n in ordered], dtype=np.float64),
            node_cpu=np.array([n.cpu for n in ordered], dtype=np.float64),
            node_memory=np.array([n.memory_gb for n in ordered], dtype=np.float64),
            usable=np.array([n.healthy for n in ordered], dtype=np.bool_),
            spot=np.array([n.price_tier is PriceTier.SPOT for n in ordered], dtype=np.bool_),
            effective_cost=_effective_costs(ordered, clusters, fallback_prices),
            domains={lvl: codes for lvl, (codes, _) in domains.items()},
            domain_names={lvl: names for lvl, (_, names) in domains.items()},
            free_whole=np.array([n.accelerators for n in ordered], dtype=np.int64),
            device_used=_padding(ordered, max(max_devices, 1)),
            free_cpu=np.array([n.cpu for n in ordered], dtype=np.float64),
            free_memory=np.array([n.memory_gb for n in ordered], dtype=np.float64),
            free_milli=np.array([n.accelerators * MILLI for n in ordered], dtype=np.int64),
            free_total=np.array([n.accelerators for n in ordered], dtype=np.float64),
            cluster_free_milli=(_per_cluster(ordered, cluster_names) * MILLI).astype(np.int64),
            cluster_free=_per_cluster(ordered, cluster_names),
            cluster_devices=_per_cluster(ordered, cluster_names),
            held=np.full(len(ordered), -1, dtype=np.int64),
            type_devices_milli=_per_type(ordered, type_names),
            type_free_milli=_per_type(ordered, type_names),
            type_claimed_milli=np.zeros(len(type_names), dtype=np.int64),
        )

    def copy(self) -> Capacity:
        """A what-if copy: static arrays are shared, free capacity is not."""
        return replace(
            self,
            free_whole=self.free_whole.copy(),
            device_used=self.device_used.copy(),
            free_cpu=self.free_cpu.copy(),
            free_memory=self.free_memory.copy(),
            free_milli=self.free_milli.copy(),
            free_total=self.free_total.copy(),
            cluster_free_milli=self.cluster_free_milli.copy(),
            cluster_free=self.cluster_free.copy(),
            held=self.held.copy(),
            type_free_milli=self.type_free_milli.copy(),
            type_claimed_milli=self.type_claimed_milli.copy(),
            _candidates=self._candidates,
            empty_fits=self.empty_fits,
            spread={g: dict(on) for g, on in self.spread.items()},
        )

    def candidates(
        self, types: tuple[str, ...], min_memory_gb: float | None, spot_ok: bool
    ) -> IntArray:
        """Indices of healthy nodes whose accelerator the job accepts (cached per shape)."""
        key = (types, min_memory_gb, spot_ok)
        cached = self._candidates.get(key)
        if cached is None:
            mask = self.usable.copy()
            if types:
                wanted = [i for i, t in enumerate(self.type_names) if t in types]
                mask &= np.isin(self.type_of, np.array(wanted, dtype=np.int64))
            if min_memory_gb is not None:
                mask &= self.device_memory >= min_memory_gb - EPS
            if not spot_ok:
                mask &= ~self.spot
            cached = np.flatnonzero(mask).astype(np.int64)
            self._candidates[key] = cached
        return cached

    def slots(self, idx: IntArray, accelerators: float, cpu: float, memory_gb: float) -> IntArray:
        """How many replicas of this shape each node in `idx` could take right now."""
        by_cpu = _fits(self.free_cpu[idx], cpu)
        by_memory = _fits(self.free_memory[idx], memory_gb)
        slots = np.minimum(by_cpu, by_memory)
        if accelerators >= 1:
            slots = np.minimum(slots, self.free_whole[idx] // round(accelerators))
        elif accelerators > 0:
            m = milli(accelerators)
            used = self.device_used[idx]
            open_devices = (used > 0) & (used < MILLI)
            in_shared = np.where(open_devices, (MILLI - used) // m, 0).sum(axis=1)
            slots = np.minimum(slots, self.free_whole[idx] * (MILLI // m) + in_shared)
        return slots

    def free_accelerators(self, idx: IntArray) -> FloatArray:
        free: FloatArray = self.free_total[idx]
        return free

    def take(
        self,
        node: int,
        accelerators: float,
        cpu: float,
        memory_gb: float,
        devices: tuple[int, ...] = (),
    ) -> tuple[int, ...]:
        """Charges one replica to a node (on `devices` if given and valid for the node, as a
        placement names them; else on the devices the packing rule picks); the devices it
        took. The caller has checked that it fits."""
        self.free_cpu[node] -= cpu
        self.free_memory[node] -= memory_gb
        named = self._valid(node, accelerators, devices)
        if accelerators >= 1:
            chosen = named or self._untouched(node, round(accelerators))
            self._use_whole(node, chosen, MILLI)
        elif accelerators > 0:
            device = named[0] if named else self._device_for(node, milli(accelerators))
            if device < 0:
                return ()  # a node with no device left (its plugin stopped offering them)
            chosen = (device,)
            self._use(node, device, milli(accelerators))
        else:
            chosen = ()
        return tuple(chosen)

    def give(
        self,
        node: int,
        accelerators: float,
        cpu: float,
        memory_gb: float,
        devices: tuple[int, ...] = (),
    ) -> None:
        """Credits one replica back: the exact inverse of `take` on the same devices (a
        replica that names none, from before placements named them, gives back what the
        packing rule would have taken: the lowest full devices, or the device holding its
        fraction most tightly)."""
        self.free_cpu[node] += cpu
        self.free_memory[node] += memory_gb
        named = self._valid(node, accelerators, devices)
        if accelerators >= 1:
            if not named:
                row = self.device_used[node, : int(self.devices[node])]
                named = tuple(int(d) for d in np.flatnonzero(row >= MILLI)[: round(accelerators)])
            self._use_whole(node, named, -MILLI)
        elif accelerators > 0:
            m = milli(accelerators)
            if named:
                self._use(node, named[0], -m)
                return
            row = self.device_used[node, : int(self.devices[node])]
            holding = (row >= m) & (row < MILLI)
            if not holding.any():
                holding = row >= m
            if holding.any():
                self._use(node, int(np.argmin(np.where(holding, row, MILLI + 1))), -m)

    def _valid(self, node: int, accelerators: float, devices: tuple[int, ...]) -> tuple[int, ...]:
        """`devices` if they can be this replica's on this node (distinct, on the node, as many
        as it takes); else () and the packing rule decides. A node that lost devices since, or
        a careless producer, must never index past the node's devices."""
        if not devices:
            return ()
        count = round(accelerators) if accelerators >= 1 else 1
        limit = int(self.devices[node])
        if len(devices) != count or len(set(devices)) != count:
            return ()
        if any(d < 0 or d >= limit for d in devices):
            return ()
        return devices

    def _use_whole(self, node: int, devices: tuple[int, ...], amount: int) -> None:
        """Whole devices taken (`amount` MILLI) or given back (-MILLI), totals kept once."""
        if not devices:
            return
        row = self.device_used[node]
        delta = untouched = 0
        for d in devices:  # a few devices: scalar steps beat numpy's fancy indexing
            before = int(row[d])
            after = max(before + amount, 0)
            row[d] = after
            delta += after - before
            untouched += (before > 0 and after == 0) - (before == 0 and after > 0)
        self.free_whole[node] += untouched
        self.free_milli[node] -= delta
        self.free_total[node] = self.free_milli[node] / MILLI
        cluster = self.cluster_of[node]
        self.cluster_free_milli[cluster] -= delta
        self.cluster_free[cluster] = self.cluster_free_milli[cluster] / MILLI
        if self.usable[node]:
            self.type_free_milli[self.type_of[node]] -= delta

    def _use(self, node: int, device: int, amount: int) -> None:
        """Add `amount` thousandths to one device's use (negative: give back), keeping the
        untouched count and the free totals in step."""
        before = int(self.device_used[node, device])
        after = max(before + amount, 0)
        self.device_used[node, device] = after
        if before == 0 and after > 0:
            self.free_whole[node] -= 1
        elif before > 0 and after == 0:
            self.free_whole[node] += 1
        delta = after - before
        self.free_milli[node] -= delta
        self.free_total[node] = self.free_milli[node] / MILLI
        cluster = self.cluster_of[node]
        self.cluster_free_milli[cluster] -= delta
        self.cluster_free[cluster] = self.cluster_free_milli[cluster] / MILLI
        if self.usable[node]:
            self.type_free_milli[self.type_of[node]] -= delta

    def _untouched(self, node: int, count: int) -> tuple[int, ...]:
        row = self.device_used[node, : int(self.devices[node])]
        return tuple(int(d) for d in np.flatnonzero(row == 0)[:count])

    def _device_for(self, node: int, m: int) -> int:
        """The fullest open device `m` thousandths still fit on, else the first untouched, else
        the least used (a charge the caller did not check, e.g. running work on a node that
        shrank); -1 for a node with no devices."""
        row = self.device_used[node, : int(self.devices[node])]
        if row.size == 0:
            return -1
        fits = (row > 0) & (row + m <= MILLI)
        if fits.any():
            return int(np.argmax(np.where(fits, row, -1)))
        untouched = row == 0
        return int(np.argmax(untouched)) if untouched.any() else int(np.argmin(row))

    def charge(self, allocations: Iterable[Allocation]) -> None:
        """Charges running work: replicas on the devices they name first, exactly; then any
        that name none (placed before placements named devices), whole devices first so
        fractions pack onto what remains."""
        allocations = tuple(allocations)
        replicas = [r for a in allocations for r in a.replicas if r.node_id in self.index]
        replicas.sort(key=lambda r: (not r.devices, r.accelerators < 1, -r.accelerators, r.node_id))
        for r in replicas:
            self.take(self.index[r.node_id], r.accelerators, r.cpu, r.memory_gb, r.devices)
        for a in allocations:
            self.count_job(a.job, a.replicas, 1)

    def release(self, replicas: Iterable[ReplicaPlacement], job: JobRequest) -> None:
        """Gives back what `job`'s `replicas` hold."""
        replicas = tuple(replicas)
        for r in replicas:
            node = self.index.get(r.node_id)
            if node is not None:
                self.give(node, r.accelerators, r.cpu, r.memory_gb, r.devices)
        self.count_job(job, replicas, -1)

    def count_job(self, job: JobRequest, replicas: Sequence[ReplicaPlacement], sign: int) -> None:
        """Counts (sign 1) or uncounts (-1) what a job's replicas stand for beyond the room
        they take: its spread group, and its claim on the type it runs on if it is restricted to
        some of the fleet's accelerator types."""
        self.count_group(job.spread_group, replicas, sign)
        if not self.restricted(job.accelerator_types):
            return
        for r in replicas:
            node = self.index.get(r.node_id)
            if node is not None and self.usable[node]:
                self.type_claimed_milli[self.type_of[node]] += sign * milli(r.accelerators)

    def restricted(self, types: tuple[str, ...]) -> bool:
        """Whether a job accepting `types` (empty: any) refuses some type of this fleet."""
        return bool(types) and not set(self.type_names) <= set(types)

    def count_group(
        self, group: str | None, replicas: Iterable[ReplicaPlacement], sign: int
    ) -> None:
        """Counts (sign 1) or uncounts (-1) a spread group's replicas on their nodes."""
        if group is None:
            return
        on = self.spread.setdefault(group, {})
        for r in replicas:
            node = self.index.get(r.node_id)
            if node is None:
                continue
            left = on.get(node, 0) + sign
            if left > 0:
                on[node] = left
            else:
                on.pop(node, None)
        if not on:
            del self.spread[group]


def _per_cluster(nodes: Sequence[Node], names: Sequence[ClusterId]) -> FloatArray:
    lookup = {name: i for i, name in enumerate(names)}
    out = np.zeros(len(names), dtype=np.float64)
    for n in nodes:
        if n.healthy:
            out[lookup[n.cluster]] += n.accelerators
    return out


def _per_type(nodes: Sequence[Node], names: Sequence[str]) -> IntArray:
    """Devices of usable (healthy) nodes per accelerator type, in thousandths."""
    totals = np.zeros(len(names), dtype=np.int64)
    codes = {name: i for i, name in enumerate(names)}
    for n in nodes:
        if n.healthy:
            totals[codes[n.accelerator.type]] += n.accelerators * MILLI
    return totals


def _padding(nodes: Sequence[Node], width: int) -> IntArray:
    """Device use per node: 0 for each device it has, MILLI past them (never free)."""
    used = np.full((len(nodes), width), MILLI, dtype=np.int64)
    for i, n in enumerate(nodes):
        used[i, : n.accelerators] = 0
    return used


def _fits(free: FloatArray, need: float) -> IntArray:
    if need <= 0:
        # Resources a replica does not ask for never limit how many fit; cap at a large count.
        return np.full(free.shape, 1 << 20, dtype=np.int64)
    return np.floor(np.maximum(free, 0.0) / need + EPS).astype(np.int64)


def _codes(values: Sequence[str], names: Sequence[str]) -> IntArray:
    lookup = {name: i for i, name in enumerate(names)}
    return np.array([lookup[v] for v in values], dtype=np.int64)


def _domain_key(node: Node, level: TopologyLevel) -> str:
    if level is TopologyLevel.NODE:
        return node.node_id
    if level is TopologyLevel.NVLINK:
        return f"{node.cluster}/{node.block}/{node.rack}/{node.nvlink_domain}"
    if level is TopologyLevel.RACK:
        return f"{node.cluster}/{node.block}/{node.rack}"
    if level is TopologyLevel.BLOCK:
        return f"{node.cluster}/{node.block}"
    return node.cluster


def _domain_codes(nodes: list[Node], level: TopologyLevel) -> tuple[IntArray, list[str]]:
    keys = [_domain_key(n, level) for n in nodes]
    names = sorted(set(keys))
    return _codes(keys, names), names


def _effective_costs(
    nodes: list[Node],
    clusters: Mapping[ClusterId, Cluster],
    fallback: Mapping[tuple[str, PriceTier], float],
) -> FloatArray:
    costs = np.zeros(len(nodes), dtype=np.float64)
    for i, n in enumerate(nodes):
        key = (n.accelerator.type, n.price_tier)
        cluster = clusters.get(n.cluster)
        price = cluster.prices.get(key) if cluster is not None else None
        if price is None:
            # An unpriced device counts as free: we cannot prefer what we cannot compare.
            price = fallback.get(key, 0.0)
        costs[i] = price / max(n.accelerator.relative_speed, EPS)
    return costs
