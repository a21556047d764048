"""The scheduler's in-memory view of the fleet and of pending and running work, built only
from events. Replaying the topics from the start rebuilds it exactly."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from core.model import Allocation, Cluster, ClusterId, JobId, JobRequest, Node, NodeId, Snapshot
from core.service import MAX_SERVICE, ServiceHistory
from schemas.events import (
    ClusterCapacity,
    JobFinished,
    JobPreempted,
    JobQueued,
    PlacementHead,
    PlacementRefused,
    PreemptionCanceled,
    PreemptionRequested,
    RunFailed,
)
from schemas.usage import BudgetExceeded, Enforcement
from services.scheduler.convert import allocation_from_event, cluster_and_nodes, job_request

_V = TypeVar("_V")

# Finished ids are remembered so a late `job.queued` cannot resurrect a job; bounded.
FINISHED_MEMORY = 500_000
# After the preemptor declines to preempt a run, it is no victim for this long (wall seconds),
# so the next cycle does not ask for the same run again at once.
DECLINED_PROTECTION_S = 30.0
# A job refused by executors more than once waits this long (wall seconds) before it is placed
# again, doubling per refusal up to the cap. The first refusal is retried at once: it is
# usually a view one cycle old.
REFUSAL_BACKOFF_S = 0.5
REFUSAL_BACKOFF_CAP_S = 30.0
STALE_EPOCH = "stale_epoch"  # the executor's reason for a deposed leader's placement
# Own placements noted beyond twice the running jobs before the stale ones go (see note_own).
OWN_SLACK = 1000


class Tracked(dict[JobId, _V]):
    """A dict that notes every key written or removed in `touched`, so the working set the core
    decides on (`services.scheduler.working`) follows what changed instead of being rebuilt.
    Every mutating method is overridden: dict's own ones do not call each other."""

    def __init__(self, touched: set[JobId]) -> None:
        super().__init__()
        self.touched = touched

    def __setitem__(self, key: JobId, value: _V) -> None:
        self.touched.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: JobId) -> None:
        self.touched.add(key)
        super().__delitem__(key)

    def pop(self, key: JobId, *default: Any) -> Any:
        self.touched.add(key)
        return super().pop(key, *default)

    def setdefault(self, key: JobId, default: Any = None) -> Any:
        self.touched.add(key)
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        changes = dict(*args, **kwargs)
        self.touched.update(changes)
        super().update(changes)

    def popitem(self) -> tuple[JobId, _V]:
        key, value = super().popitem()
        self.touched.add(key)
        return key, value

    def clear(self) -> None:
        self.touched.update(self)
        super().clear()

    def __ior__(self, other: Any) -> Tracked[_V]:  # type: ignore[override,misc]
        self.update(other)
        return self


class Attained(Mapping[JobId, float]):
    """A job's attained service (accelerator-seconds) at fleet time `at`: `served` by its
    ended runs plus the running one's so far."""

    def __init__(self, state: SchedulerState, at: float) -> None:
        self._state, self._at = state, at

    def get(self, job_id: JobId, default: float | None = None) -> float | None:  # type: ignore[override]
        served = self._state.served.get(job_id)
        alloc = self._state.running.get(job_id)
        if alloc is None:
            return default if served is None else served[1]
        ran = max(0.0, self._at - alloc.start_time) * max(alloc.job.total_accelerators, 0.0)
        return (0.0 if served is None else served[1]) + ran

    def __getitem__(self, job_id: JobId) -> float:
        value = self.get(job_id)
        if value is None:
            raise KeyError(job_id)
        return value

    def __iter__(self) -> Iterator[JobId]:
        return iter(set(self._state.served) | set(self._state.running))

    def __len__(self) -> int:
        return len(set(self._state.served) | set(self._state.running))


@dataclass
class SchedulerState:
    clusters: dict[ClusterId, Cluster] = field(default_factory=dict)
    # Each cluster's last inventory as read (a snapshot stores the fleet as these).
    capacity_events: dict[ClusterId, ClusterCapacity] = field(default_factory=dict)
    nodes: dict[NodeId, Node] = field(default_factory=dict)
    pending: dict[JobId, JobRequest] = field(default_factory=dict)
    running: dict[JobId, Allocation] = field(default_factory=dict)
    queued: dict[JobId, JobQueued] = field(default_factory=dict)
    attempts: dict[JobId, int] = field(default_factory=dict)
    running_attempt: dict[JobId, int] = field(default_factory=dict)
    # The leader epoch of each running placement: two leaders can place the same attempt (a
    # deposed one still publishing), and an executor's refusal names the epoch it refused.
    running_epoch: dict[JobId, int] = field(default_factory=dict)
    # Placements read before their job.queued (topics are not ordered with each other, e.g. on
    # a replay): applied when the job.queued arrives, so the job is not placed a second time.
    # Every copy of the highest attempt is kept (two leaders may have placed it), in log order.
    early: dict[JobId, list[tuple[PlacementHead, float]]] = field(default_factory=dict)
    # Highest leader fence read per (topic, partition): a new leader decides only once it has
    # read its own fence on every partition of the topics it decides on.
    fences: dict[tuple[str, int], int] = field(default_factory=dict)
    # Newest epoch on a placement or preemption request read (fences are counted above).
    epoch_seen: int = 0
    finished: OrderedDict[JobId, None] = field(default_factory=OrderedDict)
    # Quarantined by the health service; kept apart from the inventory, which may be re-sent.
    unhealthy: set[NodeId] = field(default_factory=set)
    # Highest attempt whose run is over (preempted, failed, requeued): a placement of it read
    # late (topics are not ordered with each other) must not take capacity again.
    closed: dict[JobId, int] = field(default_factory=dict)
    # Placements (attempt, epoch) an executor refused: read late, they take no capacity.
    refused: dict[JobId, set[tuple[int, int]]] = field(default_factory=dict)
    # (tenant, 'YYYY-MM') -> fair-share weight factor, from budgets in deprioritize mode.
    deprioritized: dict[tuple[str, str], float] = field(default_factory=dict)
    # Victims asked to yield (preemption.requested) whose run has not ended: victim ->
    # (its attempt, the job it yields to). The core neither picks them again nor counts their
    # capacity as lost for good while they leave.
    preempting: dict[JobId, tuple[int, JobId]] = field(default_factory=dict)
    # Runs the preemptor declined to preempt: no victims until this wall-clock time.
    protected: dict[JobId, float] = field(default_factory=dict)
    # Requeued jobs backing off: not placed before this wall-clock time (JobQueued.not_before).
    held: dict[JobId, float] = field(default_factory=dict)
    # Fleet seconds per wall second. The core sees fleet time, so durations in specs and the
    # policy (max runtime, minimum runtime before preemption) mean what they say.
    time_scale: float = 1.0
    # Set when something happened that could let a pending job in; the cycle clears it.
    dirty: bool = True
    # Jobs whose pending, running or held entry changed since the working set last looked
    # (`pending`, `running` and `held` note them), and a count bumped whenever the fleet (nodes,
    # their health, clusters) changes: the working set is rebuilt then.
    touched: set[JobId] = field(default_factory=set)
    fleet_version: int = 0
    # Service (accelerator-seconds, fleet time) of a job's runs that ended before its current
    # one, with the attempts counted (each run once, whatever order the topics are read in),
    # and the total service of finished jobs by kind: what learned service levels
    # (core/service.py) order by. Both come from the `ran_s` of the events that end runs.
    served: dict[JobId, tuple[frozenset[int], float]] = field(default_factory=dict)
    history: ServiceHistory = field(default_factory=ServiceHistory)
    # This leader's own placements, applied when the broker acknowledged them (Cycle.apply):
    # event id -> job id. Reading one back changes nothing, so the feed passes it by unparsed
    # (handlers.apply_records) and drops its note. A placement the feed read before the cycle
    # applied it (the feed runs while the cycle awaits acknowledgements) keeps its note.
    own: dict[str, str] = field(default_factory=dict)

    def note_own(self, event_id: str, job_id: str) -> None:
        """Notes a placement this leader applied. Past 2 x the running jobs + OWN_SLACK
        notes, those of jobs no longer running go (a record of theirs that still comes is
        parsed, as a standby's is): the map stays within about twice the running jobs, and
        the sweep costs O(1) per note over time."""
        self.own[event_id] = job_id
        if len(self.own) > 2 * len(self.running) + OWN_SLACK:
            running = self.running
            self.own = {e: j for e, j in self.own.items() if j in running}

    def __post_init__(self) -> None:
        for name in ("pending", "running", "held"):
            tracked: Tracked[Any] = Tracked(self.touched)
            tracked.update(getattr(self, name))
            setattr(self, name, tracked)

    def fleet_time(self, wall: float) -> float:
        return wall * self.time_scale

    def snapshot(self, now: float) -> Snapshot:
        """What the core may look at, at wall-clock time `now`. Changes nothing: the leader
        decides on it and applies only what it then publishes."""
        return Snapshot(
            clusters=self.clusters,
            nodes=self.nodes,
            running=self.running,
            pending=[
                job for job_id, job in self.pending.items() if self.held.get(job_id, 0.0) <= now
            ],
            preempting=frozenset(self.preempting),
            protected=frozenset(
                j for j, until in self.protected.items() if until > now and j in self.running
            ),
            attained=self.attained(now),
        )

    def backing_off(self, now: float) -> dict[JobId, float]:
        """Pending jobs still held back at `now`, with the time they may be placed."""
        return {j: t for j, t in self.held.items() if t > now and j in self.pending}

    def wake_due(self, now: float) -> bool:
        """Whether a backoff or a protection has run out, so a cycle could place more; forgets
        those that have."""
        ended = [j for j, t in self.held.items() if t <= now]
        spared = [j for j, t in self.protected.items() if t <= now]
        for job_id in ended:
            del self.held[job_id]
        for job_id in spared:
            del self.protected[job_id]
        return bool(ended or spared)

    def on_capacity(self, event: ClusterCapacity) -> None:
        """A cluster's inventory; executors re-send it now and then, so the fleet counts as
        changed only when something in it differs."""
        cluster, nodes = cluster_and_nodes(event)
        nodes = {
            n: replace(node, healthy=False) if n in self.unhealthy else node
            for n, node in nodes.items()
        }
        known = {n: node for n, node in self.nodes.items() if node.cluster == cluster.cluster_id}
        if self.clusters.get(cluster.cluster_id) != cluster or known != nodes:
            self.fleet_version += 1
        self.clusters[cluster.cluster_id] = cluster
        self.capacity_events[cluster.cluster_id] = event
        for node_id in known:
            if node_id not in nodes:
                del self.nodes[node_id]
        self.nodes.update(nodes)
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
            self.fleet_version += 1
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
        self.pending[job_id] = job_request(event, self.time_scale)
        if event.not_before is not None:
            self.held[job_id] = event.not_before.timestamp()
        else:
            self.held.pop(job_id, None)
        self.dirty = True
        for placement, at in self.early.pop(job_id, ()):
            self.on_placed(placement, at)

    def on_placed(self, event: PlacementHead, at: float) -> None:
        """A placement, ours or a previous leader's, decided at wall time `at`; applying it
        twice changes nothing."""
        job_id = JobId(event.job_id)
        self.epoch_seen = max(self.epoch_seen, event.epoch)
        if job_id in self.finished:
            return  # read after the job's end (topics are not ordered with each other)
        self.attempts[job_id] = max(self.attempts.get(job_id, 0), event.attempt)
        voided = (event.attempt, event.epoch) in self.refused.get(job_id, ())
        if voided or event.attempt <= self.closed.get(job_id, 0):
            return
        held = self.running_attempt.get(job_id, -1)
        if held > event.attempt:
            return
        if held == event.attempt:
            if event.epoch > self.running_epoch.get(job_id, 0):
                # A newer leader placed the same attempt: it never read this copy, so this copy
                # came after its fence and executors refuse it. The newer one is the run.
                job = self.running[job_id].job
                self.running[job_id] = allocation_from_event(event, job, self.fleet_time(at))
                self.running_epoch[job_id] = event.epoch
            return
        queued = self.queued.get(job_id)
        request = self.pending.pop(job_id, None) or (
            job_request(queued, self.time_scale) if queued is not None else None
        )
        if request is None:
            # Seen before its job.queued: kept, and applied when that arrives.
            known = self.early.setdefault(job_id, [])
            if known and known[0][0].attempt < event.attempt:
                known.clear()
            if not known or known[0][0].attempt == event.attempt:
                known.append((event, at))
            return
        self.held.pop(job_id, None)
        self.running[job_id] = allocation_from_event(event, request, self.fleet_time(at))
        self.running_attempt[job_id] = event.attempt
        self.running_epoch[job_id] = event.epoch

    def on_preempted(self, event: JobPreempted | RunFailed) -> None:
        """The platform ended a run, or it failed; the queue decides what happens next
        (job.queued or job.finished)."""
        job_id = JobId(event.job_id)
        self._serve(job_id, event.attempt, event.ran_s)
        self._close(job_id, event.attempt)
        if self.running_attempt.get(job_id) == event.attempt:
            self._free(job_id)

    def _serve(self, job_id: JobId, attempt: int, ran_s: float) -> None:
        """Adds one ended run's service, once per attempt, in whatever order the ends are read.
        A NaN, infinite or negative run time adds nothing; a total is capped at `MAX_SERVICE`.
        A pending job whose service changed is noted, so a kept queue re-levels it."""
        job = self._request(job_id)
        counted, total = self.served.get(job_id, (frozenset(), 0.0))
        if job is None or attempt in counted or job_id in self.finished:
            return
        ran = ran_s if 0 < ran_s < float("inf") else 0.0
        total = min(MAX_SERVICE, total + ran * max(job.total_accelerators, 0.0))
        self.served[job_id] = (counted | {attempt}, total)
        self.touched.add(job_id)

    def served_total(self, job_id: JobId) -> float:
        """Service of the job's ended runs (accelerator-seconds)."""
        served = self.served.get(job_id)
        return 0.0 if served is None else served[1]

    def _request(self, job_id: JobId) -> JobRequest | None:
        alloc = self.running.get(job_id)
        if alloc is not None:
            return alloc.job
        job = self.pending.get(job_id)
        if job is not None:
            return job
        queued = self.queued.get(job_id)
        return None if queued is None else job_request(queued, self.time_scale)

    def attained(self, now: float) -> Attained:
        """Each job's service so far at wall time `now` (ended runs plus the current one),
        worked out for the jobs a cycle asks about only."""
        return Attained(self, self.fleet_time(now))

    def _close(self, job_id: JobId, attempt: int) -> None:
        self.closed[job_id] = max(self.closed.get(job_id, 0), attempt)

    def _free(self, job_id: JobId) -> None:
        self.running.pop(job_id, None)
        self.running_attempt.pop(job_id, None)
        self.running_epoch.pop(job_id, None)
        self.preempting.pop(job_id, None)
        self.protected.pop(job_id, None)
        self.dirty = True

    def on_preemption_requested(self, event: PreemptionRequested) -> None:
        """Ours or a previous leader's: the victim's run is leaving (unless declined)."""
        self.epoch_seen = max(self.epoch_seen, event.epoch)
        job_id = JobId(event.job_id)
        if self.running_attempt.get(job_id) == event.attempt:
            self.preempting[job_id] = (event.attempt, JobId(event.for_job))

    def on_preemption_canceled(self, event: PreemptionCanceled, at: float) -> None:
        """The preemptor will not preempt this run: it stays, and is no victim for a while."""
        job_id = JobId(event.job_id)
        leaving = self.preempting.get(job_id)
        if leaving is None or leaving[0] != event.attempt:
            return
        del self.preempting[job_id]
        self.protected[job_id] = at + DECLINED_PROTECTION_S
        self.dirty = True

    def on_refused(self, event: PlacementRefused, at: float | None = None) -> None:
        """An executor would not run this placement. It voids that placement only (attempt and
        epoch): two leaders can place one attempt, and the other copy may be the run. A job
        refused again is held back (from `at`, the refusal's time) for a time that doubles with
        each refusal, so that a placement the cluster keeps refusing is not retried in a loop."""
        job_id = JobId(event.job_id)
        refusals = self.refused.setdefault(job_id, set())
        refusals.add((event.attempt, event.epoch))
        if (
            self.running_attempt.get(job_id) != event.attempt
            or self.running_epoch.get(job_id) != event.epoch
        ):
            return  # read before its placement (which is then skipped), or another copy's
        alloc = self.running.pop(job_id)
        del self.running_attempt[job_id]
        self.running_epoch.pop(job_id, None)
        self.preempting.pop(job_id, None)
        if job_id not in self.finished:
            self.pending[job_id] = alloc.job
            # Attempts refused since the job's last run ended (a requeue starts afresh); a
            # deposed leader's copy of an attempt is the same attempt, not one more refusal.
            since = self.closed.get(job_id, 0)
            streak = len({attempt for attempt, _ in refusals if attempt > since})
            if at is not None and streak > 1 and event.reason_code != STALE_EPOCH:
                wait = min(REFUSAL_BACKOFF_CAP_S, REFUSAL_BACKOFF_S * 2 ** (streak - 2))
                self.held[job_id] = max(self.held.get(job_id, 0.0), at + wait)
        self.dirty = True

    def on_finished(self, event: JobFinished) -> None:
        job_id = JobId(event.job_id)
        if event.attempt is not None and (
            event.attempt < self.running_attempt.get(job_id, 0)
            or event.attempt <= self.closed.get(job_id, 0)
        ):
            return  # the end of an older run, or of one already ended and requeued
        job = self._request(job_id)
        if job is not None and (event.attempt is not None or job_id in self.served):
            # The service the job took over all its runs, for the levels of jobs like it (the
            # queue ends a job whose retries ran out with no attempt named: its runs counted).
            if event.attempt is not None:
                self._serve(job_id, event.attempt, event.ran_s)
            self.history.record(job, self.served_total(job_id))
        self.served.pop(job_id, None)
        self.closed.pop(job_id, None)
        self.refused.pop(job_id, None)
        self.pending.pop(job_id, None)
        self.queued.pop(job_id, None)
        self.attempts.pop(job_id, None)
        self.held.pop(job_id, None)
        self.preempting.pop(job_id, None)
        self.protected.pop(job_id, None)
        freed = self.running.pop(job_id, None)
        self.running_attempt.pop(job_id, None)
        self.running_epoch.pop(job_id, None)
        self.early.pop(job_id, None)
        self.finished[job_id] = None
        if len(self.finished) > FINISHED_MEMORY:
            self.finished.popitem(last=False)
        if freed is not None:
            self.dirty = True

    def on_fence(self, topic: str, partition: int, epoch: int) -> None:
        key = (topic, partition)
        self.fences[key] = max(self.fences.get(key, 0), epoch)

    def newest_epoch(self) -> int:
        """The newest leader epoch in the log as read: fences, placements, preemption requests."""
        return max(self.epoch_seen, max(self.fences.values(), default=0))

    def fenced(self, partitions: list[tuple[str, int]], epoch: int) -> bool:
        """Whether a fence of `epoch` (or a newer one) has been read on all `partitions`."""
        return all(self.fences.get(p, 0) >= epoch for p in partitions)

    def next_attempt(self, job_id: JobId) -> int:
        return self.attempts.get(job_id, 0) + 1
