"""The leader decides, publishes, then applies: deciding changes nothing in the state; a
publish that fails in whole or in part leaves no phantom placement (no job left `running` in
memory, no accelerators that look used) for what did not reach the broker, and applies what
did; and the state moving between deciding and applying (a cancel, a capacity change, a
refusal, a run ending) raises nothing and leaves the state as the log describes it."""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import fields
from dataclasses import replace as dataclass_replace
from datetime import UTC, datetime
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from aiokafka.errors import KafkaTimeoutError, RequestTimedOutError
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry

from core.model import JobId
from schemas import topics
from schemas.events import (
    JobFinished,
    JobPreempted,
    Outcome,
    PlacementDecided,
    PlacementRefused,
)
from services.scheduler.cycle import (
    EXPLAIN_ALWAYS_UP_TO,
    EXPLAIN_GAP_S,
    EXPLAIN_MOST,
    EXPLAIN_PER_CYCLE,
    Cycle,
)
from services.scheduler.errors import PublishFailed
from services.scheduler.handlers import OWN_HEADER, SchedulerMetrics, apply_records
from services.scheduler.state import OWN_SLACK, SchedulerState
from tests.unit.services.builders import checked
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
from tests.unit.services.test_scheduler_working_set import record_of


class BrokerAway:
    """What publishing sees while the broker does not answer: the producer cannot send."""

    def __init__(self) -> None:
        self.calls = 0

    async def publish(self, *_args: Any, **_kwargs: Any) -> Any:
        self.calls += 1
        raise KafkaTimeoutError()


class LostAcks:
    """A broker that takes every message but answers with an error for the jobs in `lost`
    (a request that timed out, or a batch that expired): the producer's futures tell apart
    what the broker has from what it may not."""

    def __init__(self, lost: set[str]) -> None:
        self.lost = lost
        self.sent: list[tuple[str, dict[str, Any]]] = []

    async def publish(self, body: bytes, topic: str, **_kwargs: Any) -> asyncio.Future[None]:
        env = json.loads(body)
        self.sent.append((topic, env["payload"]))
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if env["payload"].get("job_id") in self.lost:
            answer.set_exception(RequestTimedOutError())
        else:
            answer.set_result(None)
        return answer

    def placed(self) -> list[str]:
        return [p["job_id"] for t, p in self.sent if t == topics.PLACEMENT_DECIDED]


def cycle_on(state: SchedulerState, broker: Any) -> tuple[Cycle, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    return Cycle(state, POLICY, broker, metrics, "leader-1", SCALE, checked()), registry


def used(state: SchedulerState) -> float:
    return sum(a.job.total_accelerators for a in state.running.values())


def fleet_with(nodes: int, *jobs: str) -> SchedulerState:
    state = SchedulerState(time_scale=SCALE)
    state.on_capacity(capacity(nodes))
    for job_id in jobs:
        state.on_queued(queued(job_id))
    return state


def as_read_back(state: SchedulerState, published: dict[str, Any]) -> None:
    """The feed reading one of our placements back."""
    state.on_placed(PlacementDecided.model_validate(published), NOW)


async def test_deciding_changes_nothing_in_the_state() -> None:
    state = full_fleet(started_wall=NOW - 3600)
    state.on_capacity(capacity(3))  # one free node
    for job_id, priority in (("fits", "low"), ("urgent", "critical"), ("waits", "normal")):
        state.on_queued(queued(job_id, priority))
    state.on_queued(queued("later", not_before=datetime.fromtimestamp(NOW + 60, UTC)))
    state.protected[JobId("low-a")] = NOW - 1  # a protection that ran out: still not pruned
    before = copy.deepcopy(state)
    decide, _ = cycle_on(state, BrokerAway())
    decisions = decide.decide(epoch=1, now=NOW)
    assert decisions.placements and decisions.explained  # it did decide something
    for f in fields(SchedulerState):
        if f.name == "touched":
            continue  # the working set's own bookkeeping: it has taken note of those jobs
        assert getattr(state, f.name) == getattr(before, f.name), f.name


async def test_a_failed_publish_leaves_no_phantom_placement(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, seen = broker
    state = fleet_with(1, "j1")
    away = BrokerAway()
    decide, registry = cycle_on(state, away)
    with pytest.raises(PublishFailed) as failed:
        await decide.run_once(epoch=1, now=NOW)
    assert isinstance(failed.value.__cause__, KafkaTimeoutError)
    assert away.calls == 1  # the rest would wait out the same timeout: not sent
    assert list(state.pending) == ["j1"] and state.running == {} and used(state) == 0
    assert state.next_attempt(JobId("j1")) == 1  # nothing of the failed cycle was counted
    assert state.dirty  # decided again on the next cycle
    assert decide.told == {}  # its explanations did not go out either
    assert registry.get_sample_value("qm_scheduler_publish_failures_total") == 1

    decide.broker = kafka  # the broker is back
    assert await decide.run_once(epoch=1, now=NOW + 1) == 1
    [placement] = of(seen, topics.PLACEMENT_DECIDED)
    assert (placement["job_id"], placement["attempt"]) == ("j1", 1)
    assert list(state.running) == ["j1"]


async def test_a_failed_publish_of_a_preemption_marks_no_victim_leaving() -> None:
    state = full_fleet(started_wall=NOW - 3600)
    state.on_queued(queued("urgent", "critical"))
    decide, _ = cycle_on(state, BrokerAway())
    with pytest.raises(PublishFailed):
        await decide.run_once(epoch=1, now=NOW)
    assert state.preempting == {}
    assert set(state.running) == {"low-a", "low-b"}


async def test_a_partly_failed_publish_applies_what_the_broker_acknowledged() -> None:
    """j1's placement was acknowledged, j2's was not: j1 is running here as it is in the log,
    so the next cycle does not place it a second time (which an executor would refuse as
    already running, voiding the run it does have); j2 is placed again."""
    state = fleet_with(2, "j1", "j2")
    lossy = LostAcks(lost={"j2"})
    decide, registry = cycle_on(state, lossy)
    with pytest.raises(PublishFailed, match="1 of 2 messages"):
        await decide.run_once(epoch=1, now=NOW)
    assert list(state.running) == ["j1"] and list(state.pending) == ["j2"]
    assert used(state) == 8
    assert state.next_attempt(JobId("j2")) == 1
    assert registry.get_sample_value("qm_scheduler_placements_total") == 1

    lossy.lost.clear()
    assert await decide.run_once(epoch=1, now=NOW + 1) == 1
    assert lossy.placed() == ["j1", "j2", "j2"]
    assert set(state.running) == {"j1", "j2"} and used(state) == 16
    # j2's unacknowledged copy was the same attempt on the same epoch; had it reached the log
    # after all, reading it back changes nothing.
    for payload in [p for t, p in lossy.sent if t == topics.PLACEMENT_DECIDED]:
        as_read_back(state, payload)
    assert set(state.running) == {"j1", "j2"} and used(state) == 16


async def test_a_cancel_applied_while_the_cycle_publishes_raises_nothing(
    broker: tuple[KafkaBroker, Published],
) -> None:
    """What happens to a placement that went out for a job canceled meanwhile: the queue
    cancelled it while waiting (job.finished without an attempt) and also ordered a stop, so
    an executor refuses the placement (tombstone) or, if the placement is first, runs it until
    the stop ends it (job.finished of attempt 1). Here the job holds nothing either way."""
    kafka, seen = broker
    state = fleet_with(1, "j1")
    decide, _ = cycle_on(state, kafka)

    async def feed_moves_meanwhile() -> bool:
        # The feed reads a cancel of j1 and a capacity change between decide and apply.
        state.on_finished(JobFinished(job_id="j1", outcome=Outcome.CANCELED))
        state.on_capacity(capacity(0))
        return True

    await decide.run_once(epoch=1, now=NOW, still_leading=feed_moves_meanwhile)
    [placement] = of(seen, topics.PLACEMENT_DECIDED)
    assert placement["job_id"] == "j1"
    assert "j1" not in state.running and "j1" not in state.pending and used(state) == 0
    # What follows in the log changes nothing: our placement read back, then the executor's
    # refusal of it, or its run ended by the stop order.
    as_read_back(state, placement)
    refusal = PlacementRefused(
        job_id="j1", attempt=1, epoch=1, cluster="c1", reason_code="canceled", message="x"
    )
    state.on_refused(refusal)
    state.on_finished(JobFinished(job_id="j1", attempt=1, outcome=Outcome.CANCELED))
    assert state.running == {} and state.pending == {} and used(state) == 0
    assert await decide.run_once(epoch=1, now=NOW + 1) == 0


async def test_a_node_gone_while_the_cycle_publishes_is_left_to_the_executor(
    broker: tuple[KafkaBroker, Published],
) -> None:
    """The placement went out, so it is applied as the feed would apply it, node gone or not;
    the core counts nothing on a node it does not know, and the executor's refusal frees the
    job, which is placed again (a new attempt) once the node is back."""
    kafka, seen = broker
    state = fleet_with(1, "j1")
    decide, _ = cycle_on(state, kafka)

    async def node_goes() -> bool:
        state.on_capacity(capacity(0))
        return True

    assert await decide.run_once(epoch=1, now=NOW, still_leading=node_goes) == 1
    assert list(state.running) == ["j1"]
    assert await decide.run_once(epoch=1, now=NOW + 1) == 0  # the next cycle raises nothing
    state.on_refused(
        PlacementRefused(
            job_id="j1",
            attempt=1,
            epoch=1,
            cluster="c1",
            reason_code="would_overcommit",
            message="",
        )
    )
    assert list(state.pending) == ["j1"] and state.running == {}
    state.on_capacity(capacity(1))
    assert await decide.run_once(epoch=1, now=NOW + 2) == 1
    assert [(p["job_id"], p["attempt"]) for p in of(seen, topics.PLACEMENT_DECIDED)] == [
        ("j1", 1),
        ("j1", 2),
    ]


async def test_a_placement_refused_before_it_is_applied_stays_refused(
    broker: tuple[KafkaBroker, Published],
) -> None:
    """A fast executor: the feed reads our placement and its refusal before the cycle gets to
    apply it. Applying must not bring the refused run back."""
    kafka, seen = broker
    state = fleet_with(1, "j1")
    decide, _ = cycle_on(state, kafka)
    original = decide.publish

    async def publish_then_feed(decisions: Any) -> Any:
        outcomes = await original(decisions)
        [placement] = of(seen, topics.PLACEMENT_DECIDED)
        as_read_back(state, placement)
        state.on_refused(
            PlacementRefused(
                job_id="j1", attempt=1, epoch=1, cluster="c1", reason_code="x", message=""
            )
        )
        return outcomes

    decide.publish = publish_then_feed  # type: ignore[method-assign]
    await decide.run_once(epoch=1, now=NOW)
    assert list(state.pending) == ["j1"] and state.running == {} and used(state) == 0
    assert state.next_attempt(JobId("j1")) == 2  # decided again as a new attempt


async def test_a_victim_whose_run_ended_meanwhile_is_not_marked_leaving(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, seen = broker
    state = full_fleet(started_wall=NOW - 3600)
    state.on_queued(queued("urgent", "critical"))
    decide, _ = cycle_on(state, kafka)

    async def victim_ends() -> bool:
        for victim in ("low-a", "low-b"):
            state.on_preempted(
                JobPreempted(
                    job_id=victim, attempt=1, cluster="c1", reason_code="node_lost", message=""
                )
            )
        return True

    await decide.run_once(epoch=1, now=NOW, still_leading=victim_ends)
    assert len(of(seen, topics.PREEMPTION_REQUESTED)) == 1  # it went out
    assert state.preempting == {} and state.running == {}


def test_work_waiting_for_capacity_alone_goes_out_as_demand_when_it_changes() -> None:
    state = fleet_with(1, "j1", "j2", "j3")
    state.held[JobId("j3")] = NOW + 100  # backing off: more nodes would not start it now
    cycle, _ = cycle_on(state, None)
    decisions = cycle.decide(epoch=4, now=NOW)
    assert decisions.demand is not None
    message, _signature = decisions.demand
    assert message.topic == topics.CAPACITY_DEMAND
    demand = message.envelope.payload
    assert demand["epoch"] == 4 and demand["scheduler"] == "leader-1"
    (item,) = demand["jobs"]
    assert (item["job_id"], item["replicas"], item["accelerators"]) == ("j2", 1, 8)
    assert item["accelerator_types"] == ["H100"] and "insufficient_capacity" in item["codes"]
    # Sent once: the same demand is not sent again until DEMAND_EVERY_S has passed.
    cycle.apply(decisions, [None] * len(decisions.messages()))
    assert cycle.decide(epoch=4, now=NOW + 1).demand is None
    assert cycle.decide(epoch=4, now=NOW + 16).demand is not None


def test_a_demand_carries_each_job_as_it_is_now_though_items_are_kept_between_sends() -> None:
    state = fleet_with(1, "j1", "j2")  # j1 takes the one node; j2 waits for capacity
    cycle, _ = cycle_on(state, None)

    def demand_at(now: float) -> dict[str, dict[str, Any]]:
        decisions = cycle.decide(epoch=4, now=now)
        assert decisions.demand is not None
        cycle.apply(decisions, [None] * len(decisions.messages()))
        return {item["job_id"]: item for item in decisions.demand[0].envelope.payload["jobs"]}

    first = demand_at(NOW)
    assert list(first) == ["j2"]
    state.on_queued(queued("j3"))
    second = demand_at(NOW + 2)
    assert list(second) == ["j2", "j3"] and second["j2"] == first["j2"]

    # j2 comes back asking for more memory (as after running out of it): a new request, so
    # the next demand (a changed request is a changed demand) says so, whatever was built
    # for j2 before.
    grown = queued("j2").spec.model_copy(
        update={"resources": queued("j2").spec.resources.model_copy(update={"memory_gb": 64.0})}
    )
    state.on_queued(queued("j2").model_copy(update={"spec": grown}))
    third = demand_at(NOW + 4)  # not DEMAND_EVERY_S later: the request changed
    assert (first["j2"]["memory_gb"], third["j2"]["memory_gb"]) == (32, 64)
    assert third["j2"]["codes"] == first["j2"]["codes"]  # the same codes: only the request changed
    assert third["j3"] == second["j3"]


def test_with_many_waiting_a_cycle_explains_them_at_most_every_gap() -> None:
    """Past EXPLAIN_ALWAYS_UP_TO waiting jobs, a cycle inside EXPLAIN_GAP_S of the last one
    that explained decides the same (the core's fast path) and explains nothing; the next one
    after the gap explains, the jobs that came meanwhile too."""
    waiting = [f"w{i:04d}" for i in range(EXPLAIN_ALWAYS_UP_TO + 2)]
    state = fleet_with(1, *waiting)  # one 8-accelerator node: one job of 8 at a time
    cycle, _ = cycle_on(state, None)
    first = cycle.decide(epoch=1, now=NOW)
    assert [e.job_id for _, e in first.placements] == ["w0000"]
    assert len(first.explained) == EXPLAIN_PER_CYCLE and first.demand is not None
    cycle.apply(first, [None] * len(first.messages()))
    assert not cycle.explanation_due(NOW)

    state.on_finished(JobFinished(job_id="w0000", outcome=Outcome.SUCCEEDED, attempt=1))
    state.on_queued(queued("z-late"))
    second = cycle.decide(epoch=1, now=NOW + EXPLAIN_GAP_S / 2)
    assert [e.job_id for _, e in second.placements] == ["w0001"]  # decided all the same
    assert second.explained == () and second.demand is None
    assert second.pending is first.pending  # the figures keep the last explanation
    cycle.apply(second, [None] * len(second.messages()))
    assert not cycle.explanation_due(NOW + EXPLAIN_GAP_S / 2)
    assert cycle.explanation_due(NOW + EXPLAIN_GAP_S)

    third = cycle.decide(epoch=1, now=NOW + EXPLAIN_GAP_S)
    assert third.placements == ()
    assert "z-late" in {job_id for _, job_id, _ in third.explained}
    assert "z-late" in third.pending and "w0001" not in third.pending
    assert cycle.explanation_due(NOW + EXPLAIN_GAP_S)  # owed until its messages are out
    cycle.apply(third, [None] * len(third.messages()))
    assert not cycle.explanation_due(NOW + EXPLAIN_GAP_S)
    assert not cycle.explaining(NOW + EXPLAIN_GAP_S * 1.5)


def test_with_few_waiting_every_cycle_explains() -> None:
    state = fleet_with(1, "j1", "j2")
    cycle, _ = cycle_on(state, None)
    first = cycle.decide(epoch=1, now=NOW)
    cycle.apply(first, [None] * len(first.messages()))
    state.on_queued(queued("j3"))
    second = cycle.decide(epoch=1, now=NOW + 0.01)
    assert {job_id for _, job_id, _ in second.explained} == {"j3"}
    assert not cycle.explanation_due(NOW + 0.01)


def test_the_leader_passes_its_own_placements_by_unparsed_when_read_back() -> None:
    state = fleet_with(2, "j1", "j2")
    cycle, _ = cycle_on(state, None)
    decisions = cycle.decide(epoch=1, now=NOW)
    cycle.apply(decisions, [None] * len(decisions.messages()))
    placed = [message for message, _ in decisions.placements]
    assert len(placed) == 2 and len(state.own) == 2
    running = dict(state.running)
    registry = CollectorRegistry()
    # Unparsed: bodies that could not be parsed go by without a word, and change nothing.
    apply_records(state, [record_of(m, b"\xff") for m in placed], SchedulerMetrics(registry))
    assert registry.get_sample_value("qm_scheduler_bad_records_total") == 0
    assert state.own == {} and state.running == running
    # Read back a second time (a redelivery): parsed, and still changes nothing.
    apply_records(state, [record_of(m) for m in placed], SchedulerMetrics(CollectorRegistry()))
    assert state.running == running


def test_a_placement_that_only_claims_to_be_the_leaders_own_is_read() -> None:
    state = fleet_with(2, "j1", "j2")
    cycle, _ = cycle_on(state, None)
    decisions = cycle.decide(epoch=1, now=NOW)
    cycle.apply(decisions, [None] * len(decisions.messages()))
    (first, _), (second, _) = decisions.placements
    own = dict(state.own)
    forged = [
        # An event id the leader never sent.
        replace_header(record_of(first, b"\xff"), "not-ours"),
        # One of ours, on the record of another job.
        rekey(record_of(first, b"\xff"), second.key),
    ]
    registry = CollectorRegistry()
    apply_records(state, forged, SchedulerMetrics(registry))
    assert registry.get_sample_value("qm_scheduler_bad_records_total") == 2  # both parsed
    assert state.own == own


def replace_header(record: ConsumerRecord[Any, Any], event_id: str) -> ConsumerRecord[Any, Any]:
    headers = [(n, event_id.encode() if n == OWN_HEADER else v) for n, v in record.headers]
    return dataclass_replace(record, headers=headers)


def rekey(record: ConsumerRecord[Any, Any], key: str) -> ConsumerRecord[Any, Any]:
    return dataclass_replace(record, key=key.encode())


def test_own_placements_never_read_back_do_not_pile_up() -> None:
    state = fleet_with(1)
    for i in range(3 * OWN_SLACK):
        state.note_own(f"e{i}", f"gone-{i}")  # their jobs no longer run
    assert len(state.own) <= OWN_SLACK + 1


def test_an_explaining_cycle_tells_more_for_the_cycles_that_did_not() -> None:
    """Reasons go out at the rate they did when every cycle explained: EXPLAIN_PER_CYCLE for
    each cycle since the last explaining one, up to EXPLAIN_MOST."""
    waiting = [f"w{i:05d}" for i in range(3 * EXPLAIN_MOST)]
    state = fleet_with(0, *waiting)  # no room: nothing is placed, everything waits
    cycle, _ = cycle_on(state, None)
    first = cycle.decide(epoch=1, now=NOW)
    assert len(first.explained) == EXPLAIN_PER_CYCLE
    cycle.apply(first, [None] * len(first.messages()))
    for i in range(1, 3):  # two cycles on the fast path
        fast = cycle.decide(epoch=1, now=NOW + i * EXPLAIN_GAP_S / 4)
        assert fast.explained == ()
        cycle.apply(fast, [None] * len(fast.messages()))
    due = cycle.decide(epoch=1, now=NOW + EXPLAIN_GAP_S)
    assert len(due.explained) == 3 * EXPLAIN_PER_CYCLE
    cycle.apply(due, [None] * len(due.messages()))
    for i in range(1, 9):
        cycle.apply(cycle.decide(epoch=1, now=NOW + EXPLAIN_GAP_S * (1 + i / 10)), [])
    most = cycle.decide(epoch=1, now=NOW + 2 * EXPLAIN_GAP_S)
    assert len(most.explained) == EXPLAIN_MOST  # not 9 x EXPLAIN_PER_CYCLE
