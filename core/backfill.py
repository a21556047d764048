"""Reservations for blocked big gangs, and the backfill rule: a later job may use held capacity
only if its declared max runtime ends before the gang could start, so it cannot delay it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from core.capacity import EPS, MILLI, Capacity, FloatArray, IntArray, milli
from core.model import Allocation, JobId, JobRequest, NodeId
from core.placement import levels_to_try


@dataclass(frozen=True)
class Reservation:
    number: int
    job_id: JobId
    nodes: tuple[int, ...]
    # When the held nodes are expected to be free; inf when some running job has no max runtime.
    start_estimate: float


def may_backfill(job: JobRequest, reservation: Reservation, now: float) -> bool:
    if job.max_runtime_s is None:
        return False
    return now + job.max_runtime_s <= reservation.start_estimate


def reserve(
    cap: Capacity,
    job: JobRequest,
    number: int,
    running_on: Mapping[NodeId, Mapping[JobId, Allocation]],
    spot_ok: bool,
) -> Reservation | None:
    """Holds the nodes where `job` is closest to fitting: within one domain of its topology
    level, the nodes with the most free accelerators that together could hold the gang."""
    idx = cap.candidates(job.accelerator_types, job.accelerator_memory_gb, spot_ok)
    idx = idx[cap.held[idx] < 0]
    if idx.size == 0:
        return None
    per_node = _empty_slots(cap, idx, job)
    free = cap.free_accelerators(idx)
    level = levels_to_try(job)[-1] if job.topology_required else levels_to_try(job)[0]
    codes = cap.domains[level][idx]
    best: tuple[float, int, list[int]] | None = None
    for domain in np.unique(codes):
        members = np.flatnonzero(codes == domain)
        members = members[np.lexsort((idx[members], -free[members]))]
        cumulative = np.cumsum(per_node[members])
        enough = np.flatnonzero(cumulative >= job.replicas - EPS)
        if enough.size == 0:
            continue
        take = members[: enough[0] + 1]
        score = float(free[take].sum())
        if best is None or score > best[0]:
            best = (score, int(domain), [int(i) for i in idx[take]])
    if best is None:
        return None
    nodes = tuple(best[2])
    cap.held[list(nodes)] = number
    return Reservation(number, job.job_id, nodes, _start_estimate(cap, nodes, running_on))


def _empty_slots(cap: Capacity, idx: IntArray, job: JobRequest) -> FloatArray:
    """Replicas each node could hold once empty (accelerators only: holds are approximate)."""
    devices = cap.devices[idx].astype(np.float64)
    slots: FloatArray
    if job.accelerators >= 1:
        slots = np.floor(devices / round(job.accelerators))
    elif job.accelerators > 0:
        slots = devices * float(MILLI // milli(job.accelerators))
    else:
        slots = np.full(idx.size, float(job.replicas))
    return slots


def _start_estimate(
    cap: Capacity,
    nodes: tuple[int, ...],
    running_on: Mapping[NodeId, Mapping[JobId, Allocation]],
) -> float:
    start = 0.0
    for node in nodes:
        for alloc in running_on.get(cap.nodes[node].node_id, {}).values():
            if alloc.job.max_runtime_s is None:
                return math.inf
            start = max(start, alloc.start_time + alloc.job.max_runtime_s)
    return start
