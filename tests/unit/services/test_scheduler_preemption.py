"""The scheduler's side of preemption and backoff: it asks for victims on
`preemption.requested`, never twice for one run, backs off when the preemptor declines, and
holds requeued jobs until their `not_before`. Runs the real cycle on FastStream's in-memory
broker and reads what it published."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from faststream.kafka import KafkaBroker, TestKafkaBroker
from faststream.kafka.annotations import KafkaMessage
from prometheus_client import CollectorRegistry

from core.policy import Policy
from schemas import topics
from schemas.events import (
    JobPreempted,
    JobQueued,
    PlacementDecided,
    PreemptionCanceled,
    PreemptionRequested,
    ReplicaAssignment,
)
from services.scheduler.cycle import Cycle
from services.scheduler.handlers import SchedulerMetrics
from services.scheduler.state import DECLINED_PROTECTION_S, SchedulerState
from tests.unit.services.builders import POLICY_DOC, checked, spec
from tests.unit.services.test_scheduler_state import capacity

SCALE = 600.0  # fleet seconds per wall second, as the e2e stack runs
NOW = datetime(2026, 3, 1, 12, tzinfo=UTC).timestamp()

POLICY = Policy.from_dict(
    {
        **POLICY_DOC,
        "priority_classes": [
            {"name": "low", "rank": 0},
            {"name": "normal", "rank": 10},
            {"name": "critical", "rank": 100, "preempting": True},
        ],
        "preemption": {"min_runtime_s": 600},
    }
)

Published = list[tuple[str, dict[str, Any]]]


@pytest.fixture
async def broker() -> AsyncIterator[tuple[KafkaBroker, Published]]:
    broker = KafkaBroker()
    seen: Published = []
    for topic in (
        topics.PLACEMENT_DECIDED,
        topics.PREEMPTION_REQUESTED,
        topics.SCHEDULING_EXPLAINED,
    ):

        def keeper(name: str) -> Any:
            async def keep(message: KafkaMessage) -> None:
                seen.append((name, json.loads(message.body)))

            return keep

        broker.subscriber(topic)(keeper(topic))
    async with TestKafkaBroker(broker):
        yield broker, seen


def queued(job_id: str, priority: str = "low", **extra: Any) -> JobQueued:
    job = spec(
        job_id=job_id,
        priority_class=priority,
        resources={"accelerators": 8, "accelerator_types": ["H100"]},
        checkpoint_grace_s=120,
    )
    return JobQueued(
        job_id=job_id, spec=job, submitted_at=datetime.fromtimestamp(NOW - 100, UTC), **extra
    )


def placed(job_id: str, node: str) -> PlacementDecided:
    return PlacementDecided(
        job_id=job_id,
        attempt=1,
        epoch=1,
        leader="x",
        cluster="c1",
        accelerator_type="H100",
        spec=queued(job_id).spec,
        replicas=[ReplicaAssignment(replica=0, node_id=node, accelerators=8, cpu=4, memory_gb=32)],
    )


def full_fleet(started_wall: float) -> SchedulerState:
    """Two 8-GPU nodes, each running a low-priority job started at `started_wall`."""
    state = SchedulerState(time_scale=SCALE)
    state.on_capacity(capacity(2))
    for job_id, node in (("low-a", "n0"), ("low-b", "n1")):
        state.on_queued(queued(job_id))
        state.on_placed(placed(job_id, node), started_wall)
    return state


def cycle(state: SchedulerState, broker: KafkaBroker) -> Cycle:
    metrics = SchedulerMetrics(CollectorRegistry())
    return Cycle(state, POLICY, broker, metrics, "leader-1", time_scale=SCALE, working=checked())


def of(seen: Published, topic: str) -> list[dict[str, Any]]:
    return [env["payload"] for t, env in seen if t == topic]


async def test_a_critical_job_on_a_full_fleet_asks_for_one_victim_once(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, seen = broker
    # Started 2 wall seconds ago = 1200 fleet seconds: past the 600 s minimum runtime.
    state = full_fleet(NOW - 2)
    state.on_queued(queued("urgent", "critical"))
    decide = cycle(state, kafka)

    await decide.run_once(epoch=3, now=NOW)
    requests = of(seen, topics.PREEMPTION_REQUESTED)
    assert len(requests) == 1, requests
    ask = PreemptionRequested.model_validate(requests[0])
    assert ask.job_id in {"low-a", "low-b"} and ask.for_job == "urgent"
    assert (ask.attempt, ask.epoch, ask.cluster, ask.grace_s) == (1, 3, "c1", 120)
    assert ask.reason_code == "preempted_for_priority"
    assert ask.for_claim.key() > ask.claim.key()
    assert of(seen, topics.PLACEMENT_DECIDED) == []

    # The victim is leaving: the next cycles ask for nobody else and say why the job waits.
    await decide.run_once(epoch=3, now=NOW + 0.5)
    assert len(of(seen, topics.PREEMPTION_REQUESTED)) == 1
    why = [e for e in of(seen, topics.SCHEDULING_EXPLAINED) if e["job_id"] == "urgent"]
    assert why and "awaiting_preemption" in why[-1]["codes"], why

    # The victim's run ends: the critical job lands on the node it freed.
    state.on_preempted(
        JobPreempted(
            job_id=ask.job_id,
            attempt=1,
            cluster="c1",
            reason_code="preempted_for_priority",
            message="made room",
            for_job="urgent",
        )
    )
    await decide.run_once(epoch=3, now=NOW + 1)
    placements = of(seen, topics.PLACEMENT_DECIDED)
    assert [p["job_id"] for p in placements] == ["urgent"]
    freed = "n0" if ask.job_id == "low-a" else "n1"
    assert placements[0]["replicas"][0]["node_id"] == freed


async def test_runs_younger_than_the_minimum_runtime_in_fleet_time_are_no_victims(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, seen = broker
    # 0.5 wall seconds = 300 fleet seconds: younger than the 600 s guarantee.
    state = full_fleet(NOW - 0.5)
    state.on_queued(queued("urgent", "critical"))
    await cycle(state, kafka).run_once(epoch=1, now=NOW)
    assert of(seen, topics.PREEMPTION_REQUESTED) == []


async def test_a_declined_victim_stays_and_is_spared_for_a_while(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, seen = broker
    state = full_fleet(NOW - 2)
    state.on_queued(queued("urgent", "critical"))
    decide = cycle(state, kafka)
    await decide.run_once(epoch=1, now=NOW)
    first = PreemptionRequested.model_validate(of(seen, topics.PREEMPTION_REQUESTED)[0])

    state.on_preemption_canceled(
        PreemptionCanceled(
            job_id=first.job_id,
            attempt=1,
            for_job="urgent",
            reason_code="tenant_budget",
            message="budget used",
        ),
        at=NOW + 0.1,
    )
    assert first.job_id not in state.preempting and state.dirty
    await decide.run_once(epoch=1, now=NOW + 0.2)
    asks = [PreemptionRequested.model_validate(p) for p in of(seen, topics.PREEMPTION_REQUESTED)]
    # The other run is asked instead; the declined one is not asked again while protected.
    other = "low-b" if first.job_id == "low-a" else "low-a"
    assert [a.job_id for a in asks] == [first.job_id, other]

    later = NOW + 0.1 + DECLINED_PROTECTION_S + 1
    assert state.wake_due(later)
    assert first.job_id not in state.snapshot(later).protected


async def test_a_requeued_job_waits_out_its_backoff(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, seen = broker
    state = SchedulerState(time_scale=SCALE)
    state.on_capacity(capacity(1))
    until = datetime.fromtimestamp(NOW + 5, UTC)
    state.on_queued(queued("retry", attempt=1, requeue_of_attempt=1, not_before=until))
    decide = cycle(state, kafka)

    await decide.run_once(epoch=1, now=NOW)
    assert of(seen, topics.PLACEMENT_DECIDED) == []
    why = of(seen, topics.SCHEDULING_EXPLAINED)
    assert why and why[-1]["codes"] == ["backing_off"], why
    assert not state.wake_due(NOW + 4)

    assert state.wake_due(NOW + 5)
    await decide.run_once(epoch=1, now=NOW + 5)
    assert [p["job_id"] for p in of(seen, topics.PLACEMENT_DECIDED)] == ["retry"]


def test_a_replayed_request_marks_its_victim_leaving_only_for_that_run() -> None:
    state = full_fleet(NOW - 2)
    ask = PreemptionRequested(
        job_id="low-a",
        attempt=1,
        cluster="c1",
        tenant="vision",
        priority_class="low",
        claim={"rank": 0, "guaranteed": True},
        for_job="urgent",
        for_tenant="vision",
        for_priority_class="critical",
        for_claim={"rank": 100, "guaranteed": True},
        reason_code="preempted_for_priority",
        message="m",
        grace_s=30,
        epoch=1,
        leader="x",
    )
    state.on_preemption_requested(ask)
    state.on_preemption_requested(ask.model_copy(update={"job_id": "low-b", "attempt": 7}))
    assert set(state.preempting) == {"low-a"}
    assert state.snapshot(NOW).preempting == frozenset({"low-a"})
    # Fleet time: the allocation started 2 wall seconds ago, 1200 fleet seconds.
    assert state.running["low-a"].start_time == pytest.approx((NOW - 2) * SCALE)  # type: ignore[index]


async def test_a_cycle_that_outlasts_the_lease_publishes_and_applies_nothing(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, seen = broker
    state = SchedulerState(time_scale=SCALE)
    state.on_capacity(capacity(1))
    state.on_queued(queued("j1"))
    decide = cycle(state, kafka)

    async def deposed() -> bool:
        return False

    assert await decide.run_once(epoch=1, now=NOW, still_leading=deposed) == 0
    assert seen == [] and list(state.pending) == ["j1"] and state.running == {}

    async def leading() -> bool:
        return True

    assert await decide.run_once(epoch=2, now=NOW, still_leading=leading) == 1
    assert [p["epoch"] for p in of(seen, topics.PLACEMENT_DECIDED)] == [2]
