"""The scheduler's state as one document, with the feed's position in every partition it reads,
so a start reads the latest snapshot and then only the records after it, instead of every topic
from the beginning (start-up and failover no longer grow with the log, and the broker may delete
old records: see `schemas.topics.Topic.retention_ms`).

A snapshot is taken between two batches the feed applies, so the state is exactly "every record
before `positions` applied" plus, on a leader, its own acknowledged decisions, which reading them
back changes nothing (the handlers are idempotent). Jobs are stored as their `job.queued` event
(the core's `JobRequest` is derived from it, as the feed does); the fleet as each cluster's last
`cluster.capacity` plus every node's health. Encoding and decoding run in pydantic's Rust core.

The format carries a version: a snapshot this code cannot read is ignored with a warning, and
the scheduler replays its topics instead (as it did before snapshots existed).
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, SerializeAsAny, TypeAdapter

from core.model import Allocation, ClusterId, JobId, NodeId, ReplicaPlacement
from core.service import MAX_SERVICE, ServiceHistory
from schemas.events import ClusterCapacity, JobQueued, PlacementHead
from services.scheduler.convert import job_request
from services.scheduler.feed import Mark
from services.scheduler.state import SchedulerState

FORMAT: Literal[1] = 1
# Finished ids kept in a snapshot: they stop a late `job.queued` (read out of order with
# `job.finished`, seconds apart at most) from resurrecting a job. The newest are kept.
FINISHED_IN_SNAPSHOT = 100_000

# (topic, partition) -> the feed's mark there: next offset, last record's timestamp and size.
Marks = dict[tuple[str, int], Mark]


class _Running(BaseModel):
    model_config = ConfigDict(frozen=True)
    job_id: str
    cluster: str
    # (replica, node, accelerators, cpu, memory_gb) per replica.
    replicas: list[tuple[int, str, float, float, float]]
    # Each replica's devices, in the same order (empty in snapshots written before placements
    # named devices: those replicas are charged by the packing rule).
    devices: list[list[int]] = []
    start_time: float
    attempt: int
    epoch: int


class _Early(BaseModel):
    # Read without its spec (a snapshot from before kept the whole spec: read the same way);
    # written as the instance it is.
    placement: SerializeAsAny[PlacementHead]
    at: float


class SchedulerSnapshot(BaseModel):
    """Everything `SchedulerState` holds that the log would rebuild."""

    format: Literal[1] = FORMAT
    # (topic, partition, next offset, last record's timestamp, its size): see feed.Mark.
    positions: list[tuple[str, int, int, int, int]]
    time_scale: float
    capacity: list[ClusterCapacity]
    # Every node's health as the scheduler sees it (verdicts may postdate the inventory).
    health: dict[str, bool]
    unhealthy: list[str]
    queued: list[JobQueued]
    pending: list[str]
    running: list[_Running]
    attempts: dict[str, int]
    early: dict[str, list[_Early]]
    fences: list[tuple[str, int, int]]
    epoch_seen: int
    finished: list[str]
    closed: dict[str, int]
    refused: dict[str, list[tuple[int, int]]]
    deprioritized: list[tuple[str, str, float]]
    preempting: dict[str, tuple[int, str]]
    protected: dict[str, float]
    held: dict[str, float]
    # Learned service levels (absent from snapshots written before them: empty).
    served: dict[str, tuple[list[int], float]] = {}
    # kind -> (remembered service, summary, recorded, recorded as of the summary).
    history: dict[str, tuple[list[float], list[float], int, int]] = {}
    history_refreshed_at: float | None = None

    @property
    def progress(self) -> int:
        """Records covered, summed over partitions: a later snapshot covers at least as many."""
        return sum(offset for _, _, offset, _, _ in self.positions)


def capture(state: SchedulerState, marks: Marks) -> bytes:
    """The state and the feed's positions as bytes, in one go (see `capture_in_slices`)."""
    return _frozen(state, marks).model_dump_json().encode()


async def capture_in_slices(state: SchedulerState, marks: Marks, slice_jobs: int = 1000) -> bytes:
    """The same bytes as `capture`, without stopping the event loop for the whole encoding:
    the state is taken at once (references, no await, so nothing is applied between reading
    the marks and the state; a job's `job.queued` event is never changed in place, only
    replaced), then the jobs are encoded `slice_jobs` at a time with the loop running between
    slices. 20,000 pending jobs took 1-2 s to encode in one go on a busy machine, against a
    leader lease of 3 s."""
    snap = _frozen(state, marks)
    queued = snap.queued
    head = snap.model_copy(update={"queued": []}).model_dump_json().encode()
    parts: list[bytes] = []
    for start in range(0, len(queued), slice_jobs):
        await asyncio.sleep(0)
        parts.append(_QUEUED.dump_json(queued[start : start + slice_jobs])[1:-1])
    # The empty list's place in the head: "queued":[] cannot occur inside a JSON string,
    # where every quote is escaped.
    return head.replace(b'"queued":[]', b'"queued":[' + b",".join(parts) + b"]", 1)


_QUEUED = TypeAdapter(list[JobQueued])


def _frozen(state: SchedulerState, marks: Marks) -> SchedulerSnapshot:
    finished = list(state.finished)[-FINISHED_IN_SNAPSHOT:]
    return SchedulerSnapshot.model_construct(
        format=FORMAT,
        positions=[(t, p, *mark) for (t, p), mark in sorted(marks.items())],
        time_scale=state.time_scale,
        capacity=list(state.capacity_events.values()),
        health={n: node.healthy for n, node in state.nodes.items()},
        unhealthy=sorted(state.unhealthy),
        queued=list(state.queued.values()),
        pending=list(state.pending),
        running=[
            _Running.model_construct(
                job_id=job_id,
                cluster=alloc.cluster,
                replicas=[
                    (r.replica, r.node_id, r.accelerators, r.cpu, r.memory_gb)
                    for r in alloc.replicas
                ],
                devices=[list(r.devices) for r in alloc.replicas],
                start_time=alloc.start_time,
                attempt=state.running_attempt[job_id],
                epoch=state.running_epoch.get(job_id, 0),
            )
            for job_id, alloc in state.running.items()
        ],
        attempts=dict(state.attempts),
        early={
            j: [_Early.model_construct(placement=p, at=at) for p, at in copies]
            for j, copies in state.early.items()
        },
        fences=[(t, p, e) for (t, p), e in state.fences.items()],
        epoch_seen=state.epoch_seen,
        finished=finished,
        closed=dict(state.closed),
        refused={j: sorted(pairs) for j, pairs in state.refused.items()},
        deprioritized=[(t, m, f) for (t, m), f in state.deprioritized.items()],
        preempting={j: (a, str(for_job)) for j, (a, for_job) in state.preempting.items()},
        protected=dict(state.protected),
        held=dict(state.held),
        served={j: (sorted(runs), total) for j, (runs, total) in state.served.items()},
        history=state.history.export(),
        history_refreshed_at=(
            state.history.refreshed_at if math.isfinite(state.history.refreshed_at) else None
        ),
    )


def decode(body: bytes) -> SchedulerSnapshot:
    """Raises `pydantic.ValidationError` (or ValueError) for a snapshot this code cannot read."""
    return SchedulerSnapshot.model_validate_json(body)


def restore(state: SchedulerState, snap: SchedulerSnapshot) -> Marks:
    """Fills a fresh `state` from `snap`; returns the positions to read on from."""
    if snap.time_scale != state.time_scale:
        raise ValueError(
            f"snapshot taken at time scale {snap.time_scale}, this scheduler runs at "
            f"{state.time_scale}: replaying the log instead"
        )
    state.unhealthy = {NodeId(n) for n in snap.unhealthy}
    for event in snap.capacity:
        state.on_capacity(event)
    for node_id, healthy in snap.health.items():
        node = state.nodes.get(NodeId(node_id))
        if node is not None and node.healthy != healthy:
            state.nodes[NodeId(node_id)] = replace(node, healthy=healthy)
    state.queued = {JobId(q.job_id): q for q in snap.queued}
    scale = state.time_scale
    state.pending.update(
        {JobId(j): job_request(state.queued[JobId(j)], scale) for j in snap.pending}
    )
    for r in snap.running:
        job_id = JobId(r.job_id)
        state.running[job_id] = Allocation(
            job=job_request(state.queued[job_id], scale),
            cluster=ClusterId(r.cluster),
            replicas=tuple(
                ReplicaPlacement(
                    replica,
                    NodeId(node),
                    acc,
                    cpu,
                    mem,
                    tuple(r.devices[i]) if i < len(r.devices) else (),
                )
                for i, (replica, node, acc, cpu, mem) in enumerate(r.replicas)
            ),
            start_time=r.start_time,
        )
        state.running_attempt[job_id] = r.attempt
        state.running_epoch[job_id] = r.epoch
    state.attempts = {JobId(j): a for j, a in snap.attempts.items()}
    state.early = {
        JobId(j): [(e.placement, e.at) for e in copies] for j, copies in snap.early.items()
    }
    state.fences = {(t, p): e for t, p, e in snap.fences}
    state.epoch_seen = snap.epoch_seen
    state.finished = OrderedDict((JobId(j), None) for j in snap.finished)
    state.closed = {JobId(j): a for j, a in snap.closed.items()}
    state.refused = {JobId(j): {(a, e) for a, e in pairs} for j, pairs in snap.refused.items()}
    state.deprioritized = {(t, m): f for t, m, f in snap.deprioritized}
    state.preempting = {JobId(j): (a, JobId(f)) for j, (a, f) in snap.preempting.items()}
    state.protected = {JobId(j): t for j, t in snap.protected.items()}
    state.held.update({JobId(j): t for j, t in snap.held.items()})
    state.served = {
        JobId(j): (frozenset(runs), total)
        for j, (runs, total) in snap.served.items()
        if 0 <= total <= MAX_SERVICE
    }
    state.history = ServiceHistory.restore(snap.history, snap.history_refreshed_at)
    state.dirty = True
    return marks_of(snap)


def marks_of(snap: SchedulerSnapshot) -> Marks:
    return {(t, p): (o, ts, size) for t, p, o, ts, size in snap.positions}
