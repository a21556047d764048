"""The order in which pending jobs are considered: priority tiers first (and, for least attained
service, service levels inside a tier); across tenants the lowest fair share goes next; within a
tenant, oldest first. Kept as sorted lanes so a long-lived caller can update it incrementally.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from core.model import JobId, JobRequest
from core.policy import OrderingMode, Policy

# (-rank, service level): smaller goes first.
Tier = tuple[int, int]
Entry = tuple[float, JobId, JobRequest]


def service_level(attained: float, policy: Policy) -> int:
    """Least-attained-service queue of a job: 0 until its first threshold, then 1, and so on."""
    return bisect.bisect_right(policy.las.thresholds, attained)


def tier_of(job: JobRequest, policy: Policy, attained: float) -> Tier:
    level = service_level(attained, policy) if policy.ordering is OrderingMode.LAS else 0
    return (-policy.rank(job.priority_class), level)


def lane_of(job: JobRequest, policy: Policy) -> str:
    # FIFO and LAS treat every tenant alike: one lane per tier, in arrival order.
    return job.tenant if policy.ordering is OrderingMode.FAIR_SHARE else ""


@dataclass
class PendingQueues:
    policy: Policy
    lanes: dict[Tier, dict[str, list[Entry]]] = field(default_factory=dict)
    _where: dict[JobId, tuple[Tier, str]] = field(default_factory=dict)
    # How many pending jobs ask for each per-replica accelerator amount, and how many declare a
    # max runtime (and so may backfill): lets a cycle see that nothing left can start.
    sizes: Counter[float] = field(default_factory=Counter)
    bounded_runtime_jobs: int = 0

    @classmethod
    def build(
        cls, jobs: Iterable[JobRequest], policy: Policy, attained: Mapping[JobId, float]
    ) -> PendingQueues:
        queues = cls(policy=policy)
        for job in jobs:
            tier, lane = tier_of(job, policy, attained.get(job.job_id, 0.0)), lane_of(job, policy)
            queues.lanes.setdefault(tier, {}).setdefault(lane, []).append(
                (job.submit_time, job.job_id, job)
            )
            queues._where[job.job_id] = (tier, lane)
            queues._count(job, 1)
        for lanes in queues.lanes.values():
            for entries in lanes.values():
                entries.sort(key=lambda e: (e[0], e[1]))
        return queues

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._where

    def add(self, job: JobRequest, attained: float = 0.0) -> None:
        tier = tier_of(job, self.policy, attained)
        lane = lane_of(job, self.policy)
        entries = self.lanes.setdefault(tier, {}).setdefault(lane, [])
        bisect.insort(entries, (job.submit_time, job.job_id, job), key=lambda e: (e[0], e[1]))
        self._where[job.job_id] = (tier, lane)
        self._count(job, 1)

    def remove(self, job: JobRequest) -> None:
        tier, lane = self._where.pop(job.job_id)
        entries = self.lanes[tier][lane]
        at = bisect.bisect_left(entries, (job.submit_time, job.job_id), key=lambda e: (e[0], e[1]))
        del entries[at]
        self._count(job, -1)

    def _count(self, job: JobRequest, sign: int) -> None:
        self.sizes[job.accelerators] += sign
        if self.sizes[job.accelerators] == 0:
            del self.sizes[job.accelerators]
        self.bounded_runtime_jobs += sign * (job.max_runtime_s is not None)

    def jobs(self) -> Iterator[JobRequest]:
        for tier in sorted(self.lanes):
            for lane in sorted(self.lanes[tier]):
                for entry in self.lanes[tier][lane]:
                    yield entry[2]


def in_order(queues: PendingQueues, share: Callable[[str], float]) -> Iterator[JobRequest]:
    """Yields pending jobs in policy order. `share(lane)` is read again each time a lane's next
    job is due, so placements made by the caller between two yields move that tenant back."""
    for tier in sorted(queues.lanes):
        lanes = queues.lanes[tier]
        heap = [(share(lane), lane, 0) for lane in sorted(lanes) if lanes[lane]]
        heapq.heapify(heap)
        while heap:
            _, lane, pos = heapq.heappop(heap)
            yield lanes[lane][pos][2]
            if pos + 1 < len(lanes[lane]):
                heapq.heappush(heap, (share(lane), lane, pos + 1))
