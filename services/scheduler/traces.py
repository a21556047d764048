"""The scheduler's hop of a job's trace (docs/tracing.md): `scheduler.place` spans from the
moment the feed read the job's `job.queued` to the broker acknowledging its placement, so the
wait for a cycle (and for room) is one span, with the placing cycle's start as an event."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from aiokafka import ConsumerRecord

from schemas.topics import JOB_QUEUED
from services.common.kafka import Outcome, decode_key
from services.common.tracing import Hops, Tracing, by_key, header_traceparent, hops
from services.scheduler.cycle import Decisions
from services.scheduler.state import SchedulerState

# Entries beyond the pending jobs (ones that left without a placement: canceled, read on a
# replay and placed since, or placed by another replica while this one stood by) are dropped
# once there are this many. Each prune drops more than SLACK entries: amortized O(1) per entry.
SLACK = 1024
# However many jobs are pending, no more entries than this are kept: past it the oldest go
# (those jobs' placements are then simply not traced).
MAX_WAITING = 100_000


class Waiting:
    """The trace context and arrival time of each queued job that carries one, until the
    placement of that job is acknowledged. Does nothing when tracing is off."""

    def __init__(self, tracing: Tracing | None, state: SchedulerState) -> None:
        self.tracing = tracing
        self.state = state
        self.jobs: dict[str, tuple[str, int]] = {}

    def note(self, records: Sequence[ConsumerRecord[Any, Any]]) -> None:
        """Called with every batch the feed reads, before it is applied. Only the header is
        read (the queue always sets it): no record is parsed twice."""
        if self.tracing is None:
            return
        # Pruned here, not only when placing: a standby never places, yet notes every batch.
        # Before this batch's entries go in (the state has not applied them yet).
        self._prune()
        now = time.time_ns()
        for record in records:
            if record.topic != JOB_QUEUED:
                continue
            job_id = decode_key(record)
            if job_id is None:
                continue
            traceparent = header_traceparent(record.headers)
            # Popped first so that the map stays in arrival order (oldest first).
            self.jobs.pop(job_id, None)  # a requeue without a trace: not the old one's
            if traceparent is not None:
                self.jobs[job_id] = (traceparent, now)

    def _prune(self) -> None:
        """Drop entries of jobs no longer pending once there are SLACK of them beyond the
        pending jobs; then, if still over MAX_WAITING, the oldest."""
        if len(self.jobs) > len(self.state.pending) + SLACK:
            pending = self.state.pending
            self.jobs = {j: v for j, v in self.jobs.items() if j in pending}
        over = len(self.jobs) - MAX_WAITING
        if over > 0:
            for job_id in list(itertools.islice(self.jobs, over)):
                del self.jobs[job_id]

    def placing(self, decisions: Decisions) -> Hops:
        """Spans for the cycle's placements of traced jobs, their context put on the
        placements; call before publishing."""
        traced = hops(self.tracing, "scheduler.place")
        if not self.jobs:
            return traced
        self._prune()
        for _, event in decisions.placements:
            waiting = self.jobs.get(event.job_id)
            if waiting is not None:
                traced.open(
                    event.job_id,
                    waiting[0],
                    start_ns=waiting[1],
                    job_id=event.job_id,
                    attempt=event.attempt,
                    epoch=event.epoch,
                    cluster=event.cluster,
                )
        traced.event("cycle.start", int(decisions.at * 1e9))
        traced.stamp((m for m, _ in decisions.placements), key=by_key)
        return traced

    def placed(self, traced: Hops, decisions: Decisions, outcomes: Sequence[Outcome]) -> None:
        """End the spans: a placement the broker did not take fails its span and stays
        waiting (the next cycle decides it again)."""
        failed = []
        for (_, event), outcome in zip(decisions.placements, outcomes, strict=False):
            if outcome is None:
                self.jobs.pop(event.job_id, None)
            else:
                failed.append(event.job_id)
        traced.close(failed=failed)
