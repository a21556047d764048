"""The order in which pending jobs are considered: priority tiers first (and, for least attained
service, service levels inside a tier); across tenants the lowest fair share goes next; within a
tenant, oldest first. Kept as sorted lanes so a long-lived caller can update it incrementally.

Inside a lane, jobs are further kept in groups of jobs that fare alike in a cycle (same tenant,
priority class and shape): once a cycle knows that a group's next job can only miss and change
nothing, it may pass the whole group by instead of visiting each of its jobs.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from core.model import JobId, JobRequest, TenantId
from core.placement import Shape, shape_of
from core.policy import OrderingMode, Policy
from core.service import Levels

# Added (by core.cycle) to the share of a tenant with no nominal quota left: larger than any
# real share, so a share at or above it means its tenant could only borrow.
BORROWER_OFFSET = 1e6

# (-rank, service level): smaller goes first.
Tier = tuple[int, int]
Entry = tuple[float, JobId, JobRequest]


class Group(NamedTuple):
    """Jobs that a cycle treats alike: one priority class, one shape, one service level and,
    where lanes are tenants or quotas apply, one tenant; "" where tenants cannot make a
    difference."""

    tenant: TenantId
    priority_class: str
    shape: Shape
    level: int = 0


def group_of(job: JobRequest, by_tenant: bool, level: int = 0) -> Group:
    tenant = job.tenant if by_tenant else TenantId("")
    return Group(tenant, job.priority_class, shape_of(job), level)


def _by_tenant(policy: Policy) -> bool:
    """Whether groups must keep tenants apart: where lanes are tenants, or quotas apply."""
    limited = any(t.quotas is not None for t in policy.tenants.values())
    return policy.ordering is OrderingMode.FAIR_SHARE or limited


def tier_of(job: JobRequest, levels: Levels, attained: float) -> Tier:
    """(-priority rank, service level): see core/service.py for the levels."""
    return (-levels.policy.rank(job.priority_class), levels.level(job, attained))


def lane_of(job: JobRequest, policy: Policy) -> str:
    # FIFO and LAS treat every tenant alike: one lane per tier, in arrival order.
    return job.tenant if policy.ordering is OrderingMode.FAIR_SHARE else ""


def _entry_key(entry: Entry) -> tuple[float, JobId]:
    return (entry[0], entry[1])


@dataclass
class PendingQueues:
    policy: Policy
    # tier -> lane -> group -> entries sorted by (submit time, job id).
    lanes: dict[Tier, dict[str, dict[Group, list[Entry]]]] = field(default_factory=dict)
    _where: dict[JobId, tuple[Tier, str, Group]] = field(default_factory=dict)
    by_tenant: bool = True
    # A job's level is taken when it joins (a requeued job joins again with what it attained),
    # and again for every pending job when the history levels are learned from moves on
    # (`relevel`, at the start of a cycle).
    levels: Levels | None = None
    levels_epoch: int = 0

    def __post_init__(self) -> None:
        self.by_tenant = _by_tenant(self.policy)
        if self.levels is None:
            self.levels = Levels(self.policy)

    @classmethod
    def build(
        cls,
        jobs: Iterable[JobRequest],
        policy: Policy,
        attained: Mapping[JobId, float],
        levels: Levels | None = None,
    ) -> PendingQueues:
        queues = cls(policy=policy, levels=levels)
        queues._fill(jobs, attained)
        return queues

    def _fill(self, jobs: Iterable[JobRequest], attained: Mapping[JobId, float]) -> None:
        levels = self.levels
        assert levels is not None
        self.levels_epoch = levels.epoch
        for job in jobs:
            tier = tier_of(job, levels, attained.get(job.job_id, 0.0))
            lane = lane_of(job, self.policy)
            group = group_of(job, self.by_tenant, tier[1])
            groups = self.lanes.setdefault(tier, {}).setdefault(lane, {})
            groups.setdefault(group, []).append((job.submit_time, job.job_id, job))
            self._where[job.job_id] = (tier, lane, group)
        for by_lane in self.lanes.values():
            for groups in by_lane.values():
                for entries in groups.values():
                    entries.sort(key=_entry_key)

    def __len__(self) -> int:
        return len(self._where)

    def tier(self, job_id: JobId) -> Tier | None:
        where = self._where.get(job_id)
        return None if where is None else where[0]

    def relevel(self, attained: Mapping[JobId, float]) -> None:
        """Every pending job's level again, if the learned history moved on since they were
        taken: a queue kept from cycle to cycle then orders as one built afresh would."""
        assert self.levels is not None
        if self.levels.epoch == self.levels_epoch:
            return
        jobs = list(self.jobs())
        self.lanes.clear()
        self._where.clear()
        self._fill(jobs, attained)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._where

    def add(self, job: JobRequest, attained: float = 0.0) -> None:
        assert self.levels is not None
        tier = tier_of(job, self.levels, attained)
        lane = lane_of(job, self.policy)
        group = group_of(job, self.by_tenant, tier[1])
        groups = self.lanes.setdefault(tier, {}).setdefault(lane, {})
        entries = groups.setdefault(group, [])
        bisect.insort(entries, (job.submit_time, job.job_id, job), key=_entry_key)
        self._where[job.job_id] = (tier, lane, group)

    def remove(self, job: JobRequest) -> None:
        tier, lane, group = self._where.pop(job.job_id)
        groups = self.lanes[tier][lane]
        entries = groups[group]
        del entries[bisect.bisect_left(entries, (job.submit_time, job.job_id), key=_entry_key)]
        # Empty containers are dropped so a cycle never walks what is no longer there.
        if not entries:
            del groups[group]
            if not groups:
                del self.lanes[tier][lane]
                if not self.lanes[tier]:
                    del self.lanes[tier]

    def jobs(self) -> Iterator[JobRequest]:
        """Every pending job: tier by tier, lane by lane (by name), oldest first in a lane."""
        for tier in sorted(self.lanes):
            for lane in sorted(self.lanes[tier]):
                merged = heapq.merge(*self.lanes[tier][lane].values(), key=_entry_key)
                for entry in merged:
                    yield entry[2]


def in_order(
    queues: PendingQueues,
    share: Callable[[str], float],
    settled: Callable[[Group], bool] | None = None,
) -> Iterator[JobRequest]:
    """Yields pending jobs in policy order. `share(lane)` is read again each time a lane's next
    job is due, so placements made by the caller between two yields move that tenant back.

    `settled(group)`, asked whenever a group's next job is due, lets the caller drop a group
    for the rest of the iteration; it must stay true once it has been true.
    """
    tiers = sorted(queues.lanes)
    by_tenant_lanes = queues.policy.ordering is OrderingMode.FAIR_SHARE
    i = 0
    while i < len(tiers):
        tier = tiers[i]
        same_rank = [t for t in tiers[i:] if t[0] == tier[0]]
        if by_tenant_lanes and len(same_rank) > 1:
            # Service levels under fair share: quota standing comes before the level.
            yield from _levels_of_one_rank(queues, same_rank, share, settled)
            i += len(same_rank)
            continue
        i += 1
        lanes = queues.lanes[tier]
        if len(lanes) == 1:
            yield from _lane(next(iter(lanes.values())), settled)
            continue
        streams = {lane: _lane(groups, settled) for lane, groups in lanes.items()}
        heap = [(share(lane), lane) for lane in sorted(lanes)]
        heapq.heapify(heap)
        while heap:
            _, lane = heapq.heappop(heap)
            job = next(streams[lane], None)
            if job is not None:
                yield job
                heapq.heappush(heap, (share(lane), lane))


def _levels_of_one_rank(
    queues: PendingQueues,
    tiers: list[Tier],
    share: Callable[[str], float],
    settled: Callable[[Group], bool] | None,
) -> Iterator[JobRequest]:
    """One priority rank's jobs over several service levels, tenants as lanes: a tenant still
    inside its nominal quota goes before one that could only borrow, whatever their levels
    (as in a preemption claim: rank, quota standing, then level); then the lower level; then
    the lower share. A lane's share moves when its tenant is placed, so every (level, lane)
    entry is checked against its current key when it comes up and put back if it moved."""

    def key(level: int, lane: str) -> tuple[bool, int, float, str]:
        value = share(lane)
        return (value >= BORROWER_OFFSET, level, value, lane)

    streams = {
        (tier[1], lane): _lane(groups, settled)
        for tier in tiers
        for lane, groups in queues.lanes[tier].items()
    }
    heap = [(key(level, lane), level, lane) for level, lane in streams]
    heapq.heapify(heap)
    while heap:
        stored, level, lane = heapq.heappop(heap)
        current = key(level, lane)
        if current != stored:
            heapq.heappush(heap, (current, level, lane))
            continue
        job = next(streams[(level, lane)], None)
        if job is not None:
            yield job
            heapq.heappush(heap, (key(level, lane), level, lane))


def _lane(
    groups: dict[Group, list[Entry]], settled: Callable[[Group], bool] | None
) -> Iterator[JobRequest]:
    """One lane's jobs, oldest first, merged across its groups; settled groups drop out."""
    if len(groups) == 1 and settled is None:
        for entry in next(iter(groups.values())):
            yield entry[2]
        return
    heap = [(entries[0][0], entries[0][1], group, 0) for group, entries in groups.items()]
    heapq.heapify(heap)
    while heap:
        _, _, group, pos = heap[0]
        if settled is not None and settled(group):
            heapq.heappop(heap)
            continue
        entries = groups[group]
        yield entries[pos][2]
        if pos + 1 < len(entries):
            nxt = entries[pos + 1]
            heapq.heapreplace(heap, (nxt[0], nxt[1], group, pos + 1))
        else:
            heapq.heappop(heap)
