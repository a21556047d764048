"""The fleet's free capacity while decisions are being made: numpy arrays indexed by node, charged
by every placement and credited by every release, so that nothing is ever over-committed.

Devices are not named. A node has `free_whole` untouched devices and up to `devices` shared
devices, each with a used fraction; fractional replicas pack onto shared devices, whole replicas
take untouched ones. Totals are exact; which physical device a fraction sits on is the
executor's business.
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
    Node,
    NodeId,
    PriceTier,
    ReplicaPlacement,
    TopologyLevel,
)

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

# Tolerance for sums of fractions such as 0.1 + 0.2.
EPS = 1e-9


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
    free_whole: IntArray
    shared_used: FloatArray
    free_cpu: FloatArray
    free_memory: FloatArray
    # Free accelerators per node (whole plus unused shares of open devices), kept in step.
    free_total: FloatArray
    # Free accelerators and devices per cluster, for the availability term of the score.
    cluster_free: FloatArray
    cluster_devices: FloatArray
    # Reservation number holding the node for a waiting gang, or -1.
    held: IntArray
    _candidates: dict[tuple[object, ...], IntArray] = field(default_factory=dict)
    # Whether a job shape fits an idle fleet (see `core.placement`): static, so cached here.
    empty_fits: dict[tuple[object, ...], bool] = field(default_factory=dict)

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
            shared_used=np.zeros((len(ordered), max(max_devices, 1)), dtype=np.float64),
            free_cpu=np.array([n.cpu for n in ordered], dtype=np.float64),
            free_memory=np.array([n.memory_gb for n in ordered], dtype=np.float64),
            free_total=np.array([n.accelerators for n in ordered], dtype=np.float64),
            cluster_free=_per_cluster(ordered, cluster_names),
            cluster_devices=_per_cluster(ordered, cluster_names),
            held=np.full(len(ordered), -1, dtype=np.int64),
        )

    def copy(self) -> Capacity:
        """A what-if copy: static arrays are shared, free capacity is not."""
        return replace(
            self,
            free_whole=self.free_whole.copy(),
            shared_used=self.shared_used.copy(),
            free_cpu=self.free_cpu.copy(),
            free_memory=self.free_memory.copy(),
            free_total=self.free_total.copy(),
            cluster_free=self.cluster_free.copy(),
            held=self.held.copy(),
            _candidates=self._candidates,
            empty_fits=self.empty_fits,
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
            per_device = int(np.floor(1.0 / accelerators + EPS))
            open_room = 1.0 - self.shared_used[idx]
            in_shared = np.floor(open_room / accelerators + EPS).astype(np.int64)
            in_shared[self.shared_used[idx] <= EPS] = 0
            slots = np.minimum(slots, self.free_whole[idx] * per_device + in_shared.sum(axis=1))
        return slots

    def free_accelerators(self, idx: IntArray) -> FloatArray:
        free: FloatArray = self.free_total[idx]
        return free

    def take(self, node: int, accelerators: float, cpu: float, memory_gb: float) -> None:
        """Charges one replica to a node; the caller has checked that it fits."""
        self.free_cpu[node] -= cpu
        self.free_memory[node] -= memory_gb
        self.free_total[node] -= accelerators
        self.cluster_free[self.cluster_of[node]] -= accelerators
        if accelerators >= 1:
            self.free_whole[node] -= round(accelerators)
        elif accelerators > 0:
            self._take_fraction(node, accelerators)

    def give(self, node: int, accelerators: float, cpu: float, memory_gb: float) -> None:
        """Credits one replica back, the exact inverse of `take` in totals."""
        self.free_cpu[node] += cpu
        self.free_memory[node] += memory_gb
        self.free_total[node] += accelerators
        self.cluster_free[self.cluster_of[node]] += accelerators
        if accelerators >= 1:
            self.free_whole[node] += round(accelerators)
        elif accelerators > 0:
            self._give_fraction(node, accelerators)

    def _take_fraction(self, node: int, fraction: float) -> None:
        used = self.shared_used[node]
        fits = (used > EPS) & (used + fraction <= 1.0 + EPS)
        if fits.any():
            # Tightest open device first, so fractions fill devices instead of spreading.
            slot = int(np.argmax(np.where(fits, used, -1.0)))
        else:
            slot = int(np.argmax(used <= EPS))
            self.free_whole[node] -= 1
        used[slot] += fraction

    def _give_fraction(self, node: int, fraction: float) -> None:
        used = self.shared_used[node]
        holding = used >= fraction - EPS
        slot = int(np.argmin(np.where(holding, used, np.inf)))
        used[slot] = max(0.0, used[slot] - fraction)
        if used[slot] <= EPS:
            used[slot] = 0.0
            self.free_whole[node] += 1

    def charge(self, allocations: Iterable[Allocation]) -> None:
        """Charges running work; whole devices first so fractions pack onto what remains."""
        replicas = [r for a in allocations for r in a.replicas if r.node_id in self.index]
        replicas.sort(key=lambda r: (r.accelerators < 1, -r.accelerators, r.node_id))
        for r in replicas:
            self.take(self.index[r.node_id], r.accelerators, r.cpu, r.memory_gb)

    def release(self, replicas: Iterable[ReplicaPlacement]) -> None:
        for r in replicas:
            node = self.index.get(r.node_id)
            if node is not None:
                self.give(node, r.accelerators, r.cpu, r.memory_gb)


def _per_cluster(nodes: Sequence[Node], names: Sequence[ClusterId]) -> FloatArray:
    lookup = {name: i for i, name in enumerate(names)}
    out = np.zeros(len(names), dtype=np.float64)
    for n in nodes:
        if n.healthy:
            out[lookup[n.cluster]] += n.accelerators
    return out


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
