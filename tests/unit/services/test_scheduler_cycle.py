"""The leader decides, publishes, then applies: a publish that fails leaves no phantom
placement (no job left `running` in memory, no accelerators that look used), and the state
moving between deciding and applying (a cancel, a capacity change) raises nothing."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry

from schemas.events import JobFinished, Outcome
from services.scheduler.handlers import Cycle, SchedulerMetrics
from services.scheduler.state import SchedulerState
from tests.unit.services.test_scheduler_preemption import (
    NOW,
    POLICY,
    SCALE,
    Published,
    full_fleet,
    of,
    queued,
)
from tests.unit.services.test_scheduler_preemption import broker as broker
from tests.unit.services.test_scheduler_state import capacity


class BrokerAway:
    """What publishing sees while the broker does not answer."""

    def __init__(self) -> None:
        self.calls = 0

    async def publish(self, *_args: Any, **_kwargs: Any) -> Any:
        self.calls += 1
        raise KafkaTimeoutError()


def cycle_on(state: SchedulerState, broker: Any) -> tuple[Cycle, CollectorRegistry]:
    registry = CollectorRegistry()
    return Cycle(state, POLICY, broker, SchedulerMetrics(registry), "leader-1", 1, SCALE), registry


def used(state: SchedulerState) -> float:
    return sum(a.job.total_accelerators for a in state.running.values())


async def test_a_failed_publish_leaves_no_phantom_placement(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, seen = broker
    state = SchedulerState(time_scale=SCALE)
    state.on_capacity(capacity(1))
    state.on_queued(queued("j1"))
    away = BrokerAway()
    decide, registry = cycle_on(state, away)
    with pytest.raises(KafkaTimeoutError):
        await decide.run_once(epoch=1, now=NOW)
    assert away.calls >= 1
    assert list(state.pending) == ["j1"] and state.running == {} and used(state) == 0
    assert state.next_attempt("j1") == 1  # nothing of the failed cycle was counted
    assert state.dirty  # decided again on the next cycle
    assert registry.get_sample_value("qm_scheduler_publish_failures_total") == 1

    decide.broker = kafka  # the broker is back
    assert await decide.run_once(epoch=1, now=NOW + 1) == 1
    [placement] = of(seen, "placement.decided")
    assert (placement["job_id"], placement["attempt"]) == ("j1", 1)
    assert list(state.running) == ["j1"]


async def test_a_failed_publish_of_a_preemption_marks_no_victim_leaving() -> None:
    state = full_fleet(started_wall=NOW - 3600)
    state.on_queued(queued("urgent", "critical"))
    decide, _ = cycle_on(state, BrokerAway())
    with pytest.raises(KafkaTimeoutError):
        await decide.run_once(epoch=1, now=NOW)
    assert state.preempting == {}
    assert set(state.running) == {"low-a", "low-b"}


async def test_a_cancel_applied_while_the_cycle_publishes_raises_nothing(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, seen = broker
    state = SchedulerState(time_scale=SCALE)
    state.on_capacity(capacity(1))
    state.on_queued(queued("j1"))
    decide, _ = cycle_on(state, kafka)

    async def feed_moves_meanwhile() -> bool:
        # The feed reads a cancel of j1 and a capacity change between decide and apply.
        state.on_finished(JobFinished(job_id="j1", outcome=Outcome.CANCELED))
        state.on_capacity(capacity(0))
        return True

    await decide.run_once(epoch=1, now=NOW, still_leading=feed_moves_meanwhile)
    # The placement went out (the executor refuses it: the job is tombstoned there) and the
    # canceled job holds nothing here.
    assert [p["job_id"] for p in of(seen, "placement.decided")] == ["j1"]
    assert "j1" not in state.running and used(state) == 0
