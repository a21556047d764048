"""Applying the scheduler's topics to its state, and the leader's decide-then-publish cycle."""

from __future__ import annotations

import random
import time
from typing import Any

import structlog
from aiokafka import ConsumerRecord
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import ValidationError

from core.cycle import schedule
from core.model import JobId
from core.policy import Policy
from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    ClusterCapacity,
    JobFinished,
    JobQueued,
    PlacementDecided,
    PlacementRefused,
)
from services.common.kafka import OutMessage, envelope_for, publish_all
from services.scheduler.convert import placement_event
from services.scheduler.state import SchedulerState

log = structlog.get_logger()
PRODUCER = "scheduler"

FEED_TOPICS = (
    topics.CLUSTER_CAPACITY,
    topics.JOB_QUEUED,
    topics.PLACEMENT_DECIDED,
    topics.PLACEMENT_REFUSED,
    topics.JOB_FINISHED,
)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.cycle = Histogram("qm_scheduler_cycle_seconds", "One decide cycle", registry=registry)
        self.placed = Counter(
            "qm_scheduler_placements_total", "Placements decided", registry=registry
        )
        self.pending = Gauge("qm_scheduler_pending_jobs", "Jobs waiting", registry=registry)
        self.running = Gauge(
            "qm_scheduler_running_jobs", "Jobs holding capacity", registry=registry
        )
        self.skipped = Counter(
            "qm_scheduler_bad_records_total", "Records that did not parse", registry=registry
        )
        self.leader = Gauge(
            "qm_scheduler_is_leader", "1 while this process leads", registry=registry
        )


def apply_records(
    state: SchedulerState, records: list[ConsumerRecord[Any, Any]], metrics: SchedulerMetrics
) -> None:
    """Feed records into the state. The queue dead-letters bad input; here it is only skipped."""
    for record in records:
        try:
            env = Envelope.model_validate_json(record.value or b"")
            _apply(state, record.topic, env)
        except (ValidationError, ValueError):
            metrics.skipped.inc()
            log.warning("skipping unreadable record", topic=record.topic, offset=record.offset)


def _apply(state: SchedulerState, topic: str, env: Envelope) -> None:
    if topic == topics.JOB_QUEUED:
        state.on_queued(JobQueued.model_validate(env.payload))
    elif topic == topics.PLACEMENT_DECIDED:
        state.on_placed(PlacementDecided.model_validate(env.payload), env.occurred_at.timestamp())
    elif topic == topics.PLACEMENT_REFUSED:
        state.on_refused(PlacementRefused.model_validate(env.payload))
    elif topic == topics.JOB_FINISHED:
        state.on_finished(JobFinished.model_validate(env.payload))
    elif topic == topics.CLUSTER_CAPACITY:
        state.on_capacity(ClusterCapacity.model_validate(env.payload))


class Cycle:
    """Decide with the core, apply our own decisions at once, then publish them."""

    def __init__(
        self,
        state: SchedulerState,
        policy: Policy,
        broker: KafkaBroker,
        metrics: SchedulerMetrics,
        leader: str,
        seed: int,
    ) -> None:
        self.state = state
        self.policy = policy
        self.broker = broker
        self.metrics = metrics
        self.leader = leader
        self.rng = random.Random(seed)
        self.explanations: dict[JobId, Any] = {}

    async def run_once(self, epoch: int, now: float | None = None) -> int:
        state = self.state
        now = time.time() if now is None else now
        with self.metrics.cycle.time():
            state.dirty = False
            result = schedule(state.snapshot(), self.policy, now, self.rng)
            out: list[OutMessage] = []
            for alloc in result.placements:
                job_id = alloc.job.job_id
                queued = state.queued[job_id]
                node = state.nodes[alloc.replicas[0].node_id]
                event = placement_event(
                    alloc,
                    queued,
                    attempt=state.next_attempt(job_id),
                    epoch=epoch,
                    leader=self.leader,
                    accelerator_type=node.accelerator.type,
                )
                state.on_placed(event, now)
                env = envelope_for(
                    "PlacementDecided", event, producer=PRODUCER, tenant=alloc.job.tenant
                )
                # Executors skip other clusters' placements by this header, unparsed.
                out.append(
                    OutMessage(
                        topics.PLACEMENT_DECIDED,
                        job_id,
                        env,
                        headers=(("cluster", str(alloc.cluster)),),
                    )
                )
            self.explanations = dict(result.pending)
        if out:
            await publish_all(self.broker, out)
        self.metrics.placed.inc(len(out))
        self.metrics.pending.set(len(state.pending))
        self.metrics.running.set(len(state.running))
        return len(out)
