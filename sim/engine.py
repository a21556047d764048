"""Discrete-event simulation: a virtual clock over a (time, order, sequence) heap drives the very
same `core.cycle.decide` the live scheduler uses, with one long-lived `CycleState`.

Events: a job arrives, a running job finishes, a scheduling cycle is due. A cycle runs only
after an arrival or a finish (nothing else can change a decision), at most once per
`cycle_interval_s` of virtual time; with an interval of 0 every such instant gets one.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import IntEnum

from core.capacity import EPS, MILLI, milli
from core.cycle import CycleState, decide
from core.fairshare import decay
from core.model import Allocation, Cluster, ClusterId, JobId, Node, NodeId, Snapshot, TenantId
from core.policy import Policy
from sim.workload import SimJob

# Passes of the core in one cycle's instant: each pass after one that preempted places the
# preemptors in the room their victims left (and may preempt for the next jobs in order).
PASSES_PER_CYCLE = 4


class EventKind(IntEnum):
    # Same-time order: finishes free capacity before arrivals and the cycle that sees both;
    # a node joining (sim/elastic.py) comes before the arrivals and the cycle that may use it.
    FINISH = 0
    NODE = 1
    ARRIVE = 2
    CYCLE = 3


@dataclass
class JobRecord:
    job: SimJob
    # Work left, in seconds at relative speed 1.0.
    remaining_s: float
    attained: float = 0.0
    first_start: float | None = None
    finish: float | None = None
    run_start: float | None = None
    # Relative speed of the accelerators of the current run.
    speed: float = 1.0
    preemptions: int = 0
    epoch: int = 0

    @property
    def accelerators(self) -> float:
        return self.job.request.total_accelerators


@dataclass
class Trace:
    """Aggregates the simulator keeps while running; `sim.report` turns them into figures."""

    capacity: float
    busy_integral: float = 0.0
    backlog_time: float = 0.0
    backlog_busy_integral: float = 0.0
    # (hour index) -> accelerator-seconds busy in that hour.
    hourly_busy: dict[int, float] = field(default_factory=dict)
    tenant_busy: dict[TenantId, float] = field(default_factory=dict)
    # Per tenant: seconds with some of its jobs pending, and accelerator-seconds it ran then.
    tenant_backlog_time: dict[TenantId, float] = field(default_factory=dict)
    tenant_backlog_busy: dict[TenantId, float] = field(default_factory=dict)
    preemptions: int = 0
    lost_work: float = 0.0
    cycles: int = 0
    overcommit: int = 0


class _Attained(Mapping[JobId, float]):
    """Attained service (accelerator-seconds) of every job at the cycle's `now`, computed only
    for the jobs the core asks about."""

    def __init__(self, records: dict[JobId, JobRecord], now: float) -> None:
        self._records, self._now = records, now

    def __getitem__(self, job_id: JobId) -> float:
        value = self.get(job_id)
        if value is None:
            raise KeyError(job_id)
        return value

    def get(self, job_id: JobId, default: float | None = None) -> float | None:  # type: ignore[override]
        # The core asks once per running job per cycle: one lookup, no exception handling.
        rec = self._records.get(job_id)
        if rec is None:
            return default
        if rec.run_start is None:
            return rec.attained
        return rec.attained + (self._now - rec.run_start) * rec.accelerators

    def __iter__(self) -> Iterator[JobId]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)


class Simulation:
    def __init__(
        self,
        clusters: Mapping[ClusterId, Cluster],
        nodes: Mapping[NodeId, Node],
        policy: Policy,
        jobs: list[SimJob],
        cycle_interval_s: float = 60.0,
        progress: Callable[[float], None] | None = None,
    ) -> None:
        self.policy = policy
        self.interval = cycle_interval_s
        self.progress = progress
        snapshot = Snapshot(clusters=clusters, nodes=nodes, running={}, pending=[])
        self.state = CycleState.from_snapshot(snapshot, policy)
        self.records = {j.request.job_id: JobRecord(j, j.duration_s) for j in jobs}
        self.trace = Trace(capacity=float(sum(n.accelerators for n in nodes.values())))
        self._heap: list[tuple[float, int, int, JobId, int]] = []
        self._seq = 0
        self._now = 0.0
        self._busy = 0.0
        # Per tenant: accelerators running now, jobs pending now, and since when both hold.
        self._tenant_rate: dict[TenantId, float] = {}
        self._tenant_work: dict[TenantId, float] = {}
        self._tenant_pending: dict[TenantId, int] = {}
        self._tenant_since: dict[TenantId, float] = {}
        self._usage: dict[TenantId, float] = {}
        self._usage_at = 0.0
        # An independent ledger of accelerators per node, to catch over-commit by recount.
        self._on_node: dict[NodeId, float] = {}
        self._on_device: dict[tuple[NodeId, int], int] = {}
        self._devices = {n.node_id: float(n.accelerators) for n in nodes.values()}
        self._cycle_due: float | None = None
        self._last_cycle = float("-inf")
        for j in jobs:
            self._push(j.request.submit_time, EventKind.ARRIVE, j.request.job_id)
        self._horizon = max((j.request.submit_time for j in jobs), default=0.0)
        self._reported = -1.0

    @property
    def usage(self) -> Mapping[TenantId, float]:
        """Decayed past usage per tenant as of the last cycle (what `Snapshot.usage` carries)."""
        return self._usage

    def run(self) -> dict[JobId, JobRecord]:
        while self._heap:
            at, kind, _, job_id, epoch = heapq.heappop(self._heap)
            self._advance(at)
            if kind == EventKind.ARRIVE:
                request = self.records[job_id].job.request
                self.state.queues.add(request)
                self._tenant_change(request.tenant, pending=1)
                self._want_cycle()
            elif kind == EventKind.FINISH:
                if epoch == self.records[job_id].epoch:
                    self._finish(job_id)
                    self._want_cycle()
            elif kind == EventKind.CYCLE:
                self._cycle_due = None
                self._cycle()
            else:
                self._on_node_event(job_id, epoch)
        for tenant in self._tenant_since:
            self._tenant_change(tenant)
        if self.progress is not None:
            self.progress(1.0)
        return self.records

    def _on_node_event(self, subject: str, code: int) -> None:
        """A NODE event (elastic pools only: sim/elastic.py)."""
        raise NotImplementedError("NODE events come only from sim.elastic.ElasticSimulation")

    def _push(self, at: float, kind: EventKind, job_id: JobId, epoch: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, int(kind), self._seq, job_id, epoch))

    def _want_cycle(self) -> None:
        if self._cycle_due is None:
            self._cycle_due = max(self._now, self._last_cycle + self.interval)
            self._push(self._cycle_due, EventKind.CYCLE, JobId(""))

    def _advance(self, at: float) -> None:
        dt = at - self._now
        if dt > 0:
            busy = self._busy * dt
            self.trace.busy_integral += busy
            if len(self.state.queues) > 0:
                self.trace.backlog_time += dt
                self.trace.backlog_busy_integral += busy
            self._spread_hourly(self._now, at)
            if self.progress is not None and self._horizon > 0:
                done = min(at / self._horizon, 1.0)
                if done - self._reported >= 0.002:
                    self._reported = done
                    self.progress(done)
        self._now = at

    def _spread_hourly(self, start: float, end: float) -> None:
        hour = int(start // 3600)
        hourly = self.trace.hourly_busy
        while start < end:
            edge = min(end, (hour + 1) * 3600.0)
            hourly[hour] = hourly.get(hour, 0.0) + self._busy * (edge - start)
            start, hour = edge, hour + 1

    def _cycle(self) -> None:
        self._last_cycle = self._now
        self._refresh_usage()
        for _ in range(PASSES_PER_CYCLE):
            # Another pass in the same instant lets a preemptor take the room its victims left
            # (the live scheduler cycles again as soon as a preemption has freed capacity).
            if self.state.levels.active:
                self.state.attained = _Attained(self.records, self._now)
            result = decide(self.state, self.policy, self._now, explain_pending=False)
            self.trace.cycles += 1
            for alloc in result.placements:
                self._start(alloc)
            victims = [v for p in result.preemptions for v in p.victims]
            for victim in victims:
                self._preempt(victim.job_id)
            if not victims:
                break
        else:
            self._want_cycle()  # room made in the last pass is used by the next cycle

    def _refresh_usage(self) -> None:
        """Decays past usage and adds what ran since the last cycle, in reference
        accelerator-seconds as the live scheduler's `core.fairshare.accrue_rates` from
        `ShareBook.rates` (here the running rate per tenant is already known)."""
        half_life = self.policy.fair_share.half_life_s
        elapsed = self._now - self._usage_at
        if elapsed <= 0:
            return
        self._usage_at = self._now
        for t in set(self._usage) | set(self._tenant_work):
            past = decay(self._usage.get(t, 0.0), elapsed, half_life)
            self._usage[t] = past + self._tenant_work.get(t, 0.0) * elapsed
        self.state.shares.set_usage(self._usage)

    def _start(self, alloc: Allocation) -> None:
        rec = self.records[alloc.job.job_id]
        rec.run_start = self._now
        if rec.first_start is None:
            rec.first_start = self._now
        node = self.state.cap.nodes[self.state.cap.index[alloc.replicas[0].node_id]]
        rec.speed = max(node.accelerator.relative_speed, EPS)
        self._push(
            self._now + rec.remaining_s / rec.speed,
            EventKind.FINISH,
            rec.job.request.job_id,
            rec.epoch,
        )
        self._account(alloc.job.tenant, rec.accelerators, rec.speed, pending=-1)
        self._ledger(alloc, 1.0)

    def _account(
        self, tenant: TenantId, accelerators: float, speed: float, pending: int = 0
    ) -> None:
        self._busy += accelerators
        # Fair share's usage is in reference accelerators, as the live scheduler's
        # (`ShareBook.rates`); the simulator's own tallies stay in accelerators.
        work = self._tenant_work.get(tenant, 0.0) + accelerators * speed
        self._tenant_work[tenant] = work if abs(work) > 1e-9 else 0.0
        self._tenant_change(tenant, accelerators, pending)

    def _tenant_change(self, tenant: TenantId, accelerators: float = 0.0, pending: int = 0) -> None:
        """Books a tenant's busy accelerator-seconds (in all, and while it had work waiting) up
        to now, then applies a change of its running accelerators or pending jobs."""
        since = self._tenant_since.get(tenant, self._now)
        rate = self._tenant_rate.get(tenant, 0.0)
        waiting = self._tenant_pending.get(tenant, 0)
        dt = self._now - since
        trace = self.trace
        if dt > 0:
            if rate:
                trace.tenant_busy[tenant] = trace.tenant_busy.get(tenant, 0.0) + rate * dt
            if waiting:
                backlog_busy = trace.tenant_backlog_busy
                backlog_busy[tenant] = backlog_busy.get(tenant, 0.0) + rate * dt
                backlog = trace.tenant_backlog_time
                backlog[tenant] = backlog.get(tenant, 0.0) + dt
        self._tenant_since[tenant] = self._now
        if accelerators:
            self._tenant_rate[tenant] = rate + accelerators
        if pending:
            self._tenant_pending[tenant] = waiting + pending

    def _finish(self, job_id: JobId) -> None:
        alloc = self.state.release(job_id)
        rec = self.records[job_id]
        rec.finish = self._now
        rec.attained += (self._now - (rec.run_start or self._now)) * rec.accelerators
        rec.run_start = None
        rec.remaining_s = 0.0
        # What the live scheduler learns from a job.finished: its service over all its runs.
        self.state.levels.record(alloc.job, rec.attained)
        self._account(alloc.job.tenant, -rec.accelerators, rec.speed)
        self._ledger(alloc, -1.0)

    def _preempt(self, job_id: JobId) -> None:
        alloc = self.state.release(job_id)
        rec = self.records[job_id]
        ran = self._now - (rec.run_start or self._now)
        restart = self.policy.preemption.checkpoint_restart_s
        # The job keeps its progress (checkpoint) but pays a restart before making more.
        rec.remaining_s = max(rec.remaining_s - ran * rec.speed, 0.0) + restart
        rec.attained += ran * rec.accelerators
        rec.run_start = None
        rec.preemptions += 1
        rec.epoch += 1
        self.trace.preemptions += 1
        self.trace.lost_work += restart * rec.accelerators
        self._account(alloc.job.tenant, -rec.accelerators, rec.speed, pending=1)
        self._ledger(alloc, -1.0)
        self.state.queues.add(replace(alloc.job, queued_time=self._now), rec.attained)

    def _ledger(self, alloc: Allocation, sign: float) -> None:
        """Books the allocation per node and per device it names (in thousandths, apart from
        the core's books) and counts any node or device pushed past what it has."""
        for r in alloc.replicas:
            amount = self._on_node.get(r.node_id, 0.0) + sign * r.accelerators
            self._on_node[r.node_id] = amount
            if amount > self._devices[r.node_id] + EPS:
                self.trace.overcommit += 1
            share = MILLI if r.accelerators >= 1 else milli(r.accelerators)
            for d in r.devices:
                key = (r.node_id, d)
                used = self._on_device.get(key, 0) + (share if sign > 0 else -share)
                self._on_device[key] = used
                if used > MILLI or d >= self._devices[r.node_id]:
                    self.trace.overcommit += 1
