"""The working set a scheduling cycle decides on: free capacity, running work, pending queues,
quota and fair-share books, kept consistent with each other as work starts and leaves."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from core.capacity import Capacity
from core.fairshare import ShareBook
from core.model import Allocation, JobId, NodeId, Snapshot
from core.ordering import PendingQueues
from core.policy import Policy
from core.quota import QuotaBook
from core.service import Levels


@dataclass
class CycleState:
    """The working set a cycle decides on, kept consistent by `decide` (placements become
    running) and `release` (work leaves). The live scheduler builds one per cycle from a
    snapshot; the simulator keeps one for the whole replay and updates it incrementally."""

    cap: Capacity
    running: dict[JobId, Allocation]
    queues: PendingQueues
    quota: QuotaBook
    shares: ShareBook
    # Accelerator type each running job occupies (quota and fair share are kept per type).
    types_of: dict[JobId, str]
    attained: Mapping[JobId, float] = field(default_factory=dict)
    preempting: frozenset[JobId] = frozenset()
    protected: frozenset[JobId] = frozenset()
    # Running jobs by node, kept in step with `running` (reservations estimate from it).
    on_node: dict[NodeId, dict[JobId, Allocation]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.on_node:
            for alloc in self.running.values():
                self._index(alloc, add=True)

    @property
    def levels(self) -> Levels:
        """Service levels (core/service.py), with the history the queues were built with."""
        assert self.queues.levels is not None
        return self.queues.levels

    @classmethod
    def from_snapshot(
        cls, snapshot: Snapshot, policy: Policy, levels: Levels | None = None
    ) -> CycleState:
        """`levels` carries a learned history over from state to state (the live scheduler
        keeps one for its life); None starts with none."""
        cap = Capacity.build(snapshot.nodes, snapshot.clusters, policy.prices)
        cap.charge(snapshot.running.values())
        types_of = {
            job_id: cap.type_names[int(cap.type_of[cap.index[a.replicas[0].node_id]])]
            for job_id, a in sorted(snapshot.running.items())
            if a.replicas and a.replicas[0].node_id in cap.index
        }
        typed = [(snapshot.running[j], t) for j, t in types_of.items()]
        return cls(
            cap=cap,
            running=dict(snapshot.running),
            queues=PendingQueues.build(snapshot.pending, policy, snapshot.attained, levels),
            quota=QuotaBook.build(typed, policy),
            shares=ShareBook.build(cap, typed, snapshot.usage, policy),
            types_of=types_of,
            attained=snapshot.attained,
            preempting=snapshot.preempting,
            protected=snapshot.protected,
        )

    def release(self, job_id: JobId) -> Allocation:
        """Takes a running job out (finished, failed or preempted) and frees what it held."""
        alloc = self.running.pop(job_id)
        self._index(alloc, add=False)
        self.cap.release(alloc.replicas, alloc.job)
        accelerator_type = self.types_of.pop(job_id, None)
        if accelerator_type is not None:
            if alloc.job.accelerators > 0:
                self.quota.charge(alloc.job.tenant, accelerator_type, -alloc.job.total_accelerators)
            self.shares.charge(alloc.job, accelerator_type, sign=-1.0)
        return alloc

    def admit(self, alloc: Allocation) -> None:
        """Running work this state did not decide (another leader's placement, or one read back
        from the log): charged exactly as `from_snapshot` charges what is running. Replicas on
        nodes this state does not know take nothing, as there."""
        cap = self.cap
        for r in alloc.replicas:
            node = cap.index.get(r.node_id)
            if node is not None:
                cap.take(node, r.accelerators, r.cpu, r.memory_gb, r.devices)
        cap.count_job(alloc.job, alloc.replicas, 1)
        job = alloc.job
        first = cap.index.get(alloc.replicas[0].node_id) if alloc.replicas else None
        if first is not None:
            accelerator_type = cap.type_names[int(cap.type_of[first])]
            self.types_of[job.job_id] = accelerator_type
            if job.accelerators > 0:
                self.quota.charge(job.tenant, accelerator_type, job.total_accelerators)
            self.shares.charge(job, accelerator_type)
        self.running[job.job_id] = alloc
        self._index(alloc, add=True)

    def swap(self, alloc: Allocation) -> None:
        """Replaces a running job's allocation by an equal one (same job, same replicas), e.g.
        the copy read back from the log of a placement this state decided: nothing is charged
        again, so device packing stays as it was."""
        old = self.running[alloc.job.job_id]
        self._index(old, add=False)
        self.running[alloc.job.job_id] = alloc
        self._index(alloc, add=True)

    def start(self, alloc: Allocation) -> None:
        """A placement made by `decide` becomes running work (it is already charged)."""
        self.queues.remove(alloc.job)
        self.running[alloc.job.job_id] = alloc
        self._index(alloc, add=True)

    def _index(self, alloc: Allocation, add: bool) -> None:
        job_id = alloc.job.job_id
        for node_id in {r.node_id for r in alloc.replicas}:
            if add:
                self.on_node.setdefault(node_id, {})[job_id] = alloc
            else:
                jobs = self.on_node[node_id]
                del jobs[job_id]
                if not jobs:
                    del self.on_node[node_id]
