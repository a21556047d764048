"""The scheduler's in-memory view of the fleet and of pending and running work, built only
from events. Replaying the topics from the start rebuilds it exactly."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace

from core.model import Allocation, Cluster, ClusterId, JobId, JobRequest, Node, NodeId, Snapshot
from schemas.events import (
    ClusterCapacity,
    JobFinished,
    JobPreempted,
    JobQueued,
    PlacementDecided,
    PlacementRefused,
)
from schemas.usage import BudgetExceeded, Enforcement
from services.scheduler.convert import allocation_from_event, cluster_and_nodes, job_request

# Finished ids are remembered so a late `job.queued` cannot resurrect a job; bounded.
FINISHED_MEMORY = 500_000


@dataclass
class SchedulerState:
    clusters: dict[ClusterId, Cluster] = field(default_factory=dict)
    nodes: dict[NodeId, Node] = field(default_factory=dict)
    pending: dict[JobId, JobRequest] = field(default_factory=dict)
    running: dict[JobId, Allocation] = field(default_factory=dict)
    queued: dict[JobId, JobQueued] = field(default_factory=dict)
    attempts: dict[JobId, int] = field(default_factory=dict)
    running_attempt: dict[JobId, int] = field(default_factory=dict)
    finished: OrderedDict[JobId, None] = field(default_factory=OrderedDict)
    # Quarantined by the health service; kept apart from the inventory, which may be re-sent.
    unhealthy: set[NodeId] = field(default_factory=set)
    # Highest attempt whose run is over (refused, preempted, requeued): a placement of it read
    # late (topics are not ordered with each other) must not take capacity again.
    closed: dict[JobId, int] = field(default_factory=dict)
    # (tenant, 'YYYY-MM') -> fair-share weight factor, from budgets in deprioritize mode.
    deprioritized: dict[tuple[str, str], float] = field(default_factory=dict)
    # Set when something happened that could let a pending job in; the cycle clears it.
    dirty: bool = True

    def snapshot(self) -> Snapshot:
        return Snapshot(
            clusters=self.clusters,
            nodes=self.nodes,
            running=self.running,
            pending=list(self.pending.values()),
        )

    def on_capacity(self, event: ClusterCapacity) -> None:
        cluster, nodes = cluster_and_nodes(event)
        self.clusters[cluster.cluster_id] = cluster
        for node_id in [n for n, node in self.nodes.items() if node.cluster == cluster.cluster_id]:
            if node_id not in nodes:
                del self.nodes[node_id]
        self.nodes.update(
            {
                n: replace(node, healthy=False) if n in self.unhealthy else node
                for n, node in nodes.items()
            }
        )
        self.dirty = True

    def on_budget(self, event: BudgetExceeded) -> None:
        """A tenant-wide budget in deprioritize mode is used up: lower its fair-share weight
        for the rest of that month. Project budgets notify or block; shares are per tenant."""
        if (
            event.enforcement is not Enforcement.DEPRIORITIZE
            or event.threshold_pct < 100
            or event.project is not None
            or not event.weight_factor
        ):
            return
        key = (event.tenant, event.month)
        self.deprioritized[key] = min(self.deprioritized.get(key, 1.0), event.weight_factor)
        self.dirty = True

    def weight_factors(self, month: str) -> dict[str, float]:
        return {t: f for (t, m), f in self.deprioritized.items() if m == month}

    def on_node_health(self, node_id: str, healthy: bool) -> None:
        """The health service's verdict: no new placement lands on an unhealthy node."""
        nid = NodeId(node_id)
        if healthy:
            self.unhealthy.discard(nid)
        else:
            self.unhealthy.add(nid)
        node = self.nodes.get(nid)
        if node is not None and node.healthy != healthy:
            self.nodes[nid] = replace(node, healthy=healthy)
            self.dirty = True

    def on_queued(self, event: JobQueued) -> None:
        job_id = JobId(event.job_id)
        if job_id in self.finished:
            return
        known = self.queued.get(job_id)
        if known is not None and known.attempt > event.attempt:
            return  # an older queueing, read late
        if event.requeue_of_attempt is not None:
            self._close(job_id, event.requeue_of_attempt)
        if job_id in self.running:
            ended = event.requeue_of_attempt
            if ended is None or self.running_attempt[job_id] > ended:
                return
            # A requeue after the platform ended this run: its capacity is free even if the
            # job.preempted that says so has not been read yet.
            self._free(job_id)
        self.queued[job_id] = event
        self.pending[job_id] = job_request(event)
        self.dirty = True

    def on_placed(self, event: PlacementDecided, at: float) -> None:
        """A placement, ours or a previous leader's; applying it twice changes nothing."""
        job_id = JobId(event.job_id)
        self.attempts[job_id] = max(self.attempts.get(job_id, 0), event.attempt)
        if job_id in self.finished or event.attempt <= self.closed.get(job_id, 0):
            return
        if self.running_attempt.get(job_id, -1) >= event.attempt:
            return
        queued = self.queued.get(job_id)
        request = self.pending.pop(job_id, None) or (
            job_request(queued) if queued is not None else None
        )
        if request is None:
            return  # placement seen before its job.queued; the queued event will bring it
        self.running[job_id] = allocation_from_event(event, request, at)
        self.running_attempt[job_id] = event.attempt

    def on_preempted(self, event: JobPreempted) -> None:
        """The platform ended a run; the queue decides what happens next (job.queued)."""
        job_id = JobId(event.job_id)
        self._close(job_id, event.attempt)
        if self.running_attempt.get(job_id) == event.attempt:
            self._free(job_id)

    def _close(self, job_id: JobId, attempt: int) -> None:
        self.closed[job_id] = max(self.closed.get(job_id, 0), attempt)

    def _free(self, job_id: JobId) -> None:
        self.running.pop(job_id, None)
        self.running_attempt.pop(job_id, None)
        self.dirty = True

    def on_refused(self, event: PlacementRefused) -> None:
        job_id = JobId(event.job_id)
        self._close(job_id, event.attempt)
        if self.running_attempt.get(job_id) != event.attempt:
            return
        alloc = self.running.pop(job_id)
        del self.running_attempt[job_id]
        if job_id not in self.finished:
            self.pending[job_id] = alloc.job
        self.dirty = True

    def on_finished(self, event: JobFinished) -> None:
        job_id = JobId(event.job_id)
        if event.attempt is not None and (
            event.attempt < self.running_attempt.get(job_id, 0)
            or event.attempt <= self.closed.get(job_id, 0)
        ):
            return  # the end of an older run, or of one already ended and requeued
        self.closed.pop(job_id, None)
        self.pending.pop(job_id, None)
        self.queued.pop(job_id, None)
        self.attempts.pop(job_id, None)
        freed = self.running.pop(job_id, None)
        self.running_attempt.pop(job_id, None)
        self.finished[job_id] = None
        if len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)
        if freed is not None:
            self.dirty = True

    def next_attempt(self, job_id: JobId) -> int:
        return self.attempts.get(job_id, 0) + 1
