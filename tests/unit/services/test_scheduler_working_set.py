"""The leader's kept working set follows the events exactly: after any sequence of arrivals,
placements (acknowledged or not, ours or another leader's), refusals, ends, requeues with
backoff, preemption requests, fleet and health changes, it equals the state a cycle would
rebuild from scratch. Every cycle here runs a strict check (`checked()`: it raises on any
difference), and the kept state is what the next cycle decides on."""

from __future__ import annotations

from dataclasses import fields, replace
from datetime import UTC, datetime
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from bench.inventory import inventory
from core.model import JobId, NodeId
from core.policy import Policy
from core.service import Levels
from schemas.events import Claim as WireClaim
from schemas.events import (
    ClusterCapacity,
    JobFinished,
    JobPreempted,
    JobQueued,
    Outcome,
    PlacementDecided,
    PlacementRefused,
    PreemptionCanceled,
    PreemptionRequested,
    ReplicaAssignment,
    RunFailed,
)
from schemas.usage import BudgetExceeded
from services.common.kafka import OutMessage
from services.scheduler.cycle import Cycle, Decisions
from services.scheduler.handlers import SchedulerMetrics, apply_records
from services.scheduler.state import SchedulerState
from services.scheduler.working import WorkingSet, differences
from tests.unit.services.builders import checked, spec

NOW = 1_800_000_000.0
POLICY = Policy.from_dict(
    {
        "priority_classes": [
            {"name": "low", "rank": 0},
            {"name": "normal", "rank": 10},
            {"name": "critical", "rank": 100, "preempting": True},
        ],
        "tenants": {
            "vision": {"cohort": "all", "quotas": {"H100": 16, "T4": 4}},
            "nlp": {"cohort": "all", "quotas": {"H100": 8, "T4": 4}},
        },
        "preemption": {"min_runtime_s": 0},
        # Levels learned from the runs that end below (so the kept queue re-levels its jobs).
        "service_levels": {
            "mode": "learned",
            "min_samples": 2,
            "base_s": 5,
            "ratio": 2,
            "refresh_s": 0,
        },
    }
)
# (size of a replica, replicas): whole devices, gangs and fractions of a shared device.
SHAPES = [(1.0, 1), (8.0, 1), (4.0, 2), (8.0, 2), (0.25, 1), (0.5, 1), (0.3, 1), (0.7, 1)]


def capacity(cluster: str, kind: str, count: int, devices: int) -> ClusterCapacity:
    return inventory(
        cluster,
        kind,
        count,
        devices=devices,
        name="{cluster}-n{i}",
        rack_size=2,
        generation="g",
        relative_speed=2,
    )


def queued(
    job_id: str, shape: int, tenant: str, priority: str, attempt: int = 0, **extra: Any
) -> JobQueued:
    size, replicas = SHAPES[shape]
    job = spec(
        job_id=job_id,
        tenant=tenant,
        priority_class=priority,
        replicas=replicas,
        resources={"accelerators": size, "cpu": 2, "memory_gb": 8},
    )
    return JobQueued(
        job_id=job_id,
        spec=job,
        submitted_at=datetime.fromtimestamp(NOW - 100, UTC),
        attempt=attempt,
        **extra,
    )


def record_of(message: OutMessage, value: bytes | None = None) -> ConsumerRecord[Any, Any]:
    """The record the feed reads for a published message (its body replaced by `value`)."""
    topic, key, body, headers, _ = message.wire()
    body = body if value is None else value
    wire_headers = [(name, text.encode()) for name, text in headers]
    return ConsumerRecord(topic, 0, 0, 0, 0, key.encode(), body, None, 0, len(body), wire_headers)


class Acks:
    """A broker double for `Cycle.apply`: which messages of a cycle were acknowledged."""

    def __init__(self, lose: list[bool]) -> None:
        self.lose = lose
        self.i = 0

    def outcomes(self, count: int) -> list[Exception | None]:
        out: list[Exception | None] = []
        for _ in range(count):
            lost = self.lose[self.i % len(self.lose)] if self.lose else False
            self.i += 1
            out.append(RuntimeError("not acknowledged") if lost else None)
        return out


class World:
    """Drives a SchedulerState through events and cycles the way the feed and the leader do."""

    def __init__(self, lose: list[bool]) -> None:
        self.state = SchedulerState(time_scale=1.0)
        self.state.on_capacity(capacity("c1", "H100", 4, 8))
        self.state.on_capacity(capacity("c2", "T4", 3, 2))
        registry = CollectorRegistry()
        self.working: WorkingSet = checked()
        self.cycle = Cycle(
            self.state,
            POLICY,
            broker=None,
            metrics=SchedulerMetrics(registry),  # type: ignore[arg-type]
            leader="l1",
            working=self.working,
        )
        self.acks = Acks(lose)
        self.now = NOW
        self.jobs = 0
        self.queued: dict[str, JobQueued] = {}
        # Our placements in the log not read back yet: acknowledged ones, and during a publish
        # the cycle's own (the broker may have them before the cycle applies them).
        self.published: list[OutMessage] = []
        self.in_flight: list[OutMessage] = []
        self.parse_own = False  # read our placements back parsed, as if none were noted
        # Every applied cycle's placements (job, attempt, nodes and devices) and requests.
        self.decided: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = []
        self.explaining = 0  # applied cycles that explained

    def run_cycle(self) -> None:
        decisions = self.cycle.decide(epoch=1, now=self.now)
        self.apply(decisions, [])

    def cycle_with_events_during_publish(self, steps: list[tuple[Any, ...]]) -> None:
        """Decide, let the feed apply `steps` while the publish is awaited, then apply what
        the broker acknowledged (as `Cycle.run_once` does)."""
        decisions = self.cycle.decide(epoch=1, now=self.now)
        self.in_flight = [m for m, _ in decisions.placements]
        sent = list(self.in_flight)
        play(self, [s for s in steps if s[0] not in ("cycle", "publish_gap", "lost_lease")])
        read = [m for m in sent if m not in self.in_flight]  # by the feed, during the publish
        self.in_flight = []
        self.apply(decisions, read)

    def apply(self, decisions: Decisions, read: list[OutMessage]) -> None:
        outcomes = self.acks.outcomes(len(decisions.messages()))
        self.cycle.apply(decisions, outcomes)
        self.explaining += decisions.explaining
        placed = zip(decisions.placements, outcomes[: len(decisions.placements)], strict=True)
        self.published += [m for (m, _), out in placed if out is None and m not in read]
        self.decided.append(
            (
                tuple(
                    (e.job_id, e.attempt, tuple((r.node_id, tuple(r.devices)) for r in e.replicas))
                    for _, e in decisions.placements
                ),
                tuple((r.job_id, r.for_job) for _, r in decisions.requests),
            )
        )

    def read_back(self) -> None:
        """The feed reading our placements from the log (the leader passes by the ones it
        noted as its own, unless `parse_own`)."""
        if self.parse_own:
            self.state.own.clear()
        records = [record_of(m) for m in self.published + self.in_flight]
        self.published, self.in_flight = [], []
        apply_records(self.state, records, self.cycle.metrics)

    def cycle_losing_the_lease(self) -> None:
        """Decided, then dropped unpublished (the lease ran out during the cycle)."""
        self.cycle.decide(epoch=1, now=self.now)

    def budget(self, tenant: str, factor: float) -> None:
        """A tenant's budget in deprioritize mode ran out: the policy's weights change."""
        month = datetime.fromtimestamp(self.now, UTC).strftime("%Y-%m")
        self.state.on_budget(
            BudgetExceeded(
                budget_id=f"b-{tenant}",
                tenant=tenant,
                month=month,
                unit="accelerator_hours",
                limit=10,
                used=10,
                threshold_pct=100,
                enforcement="deprioritize",
                weight_factor=factor,
                crossed_at=datetime.fromtimestamp(self.now, UTC),
                message="budget used up",
            )
        )

    def arrive(self, shape: int, tenant: str, priority: str) -> None:
        self.jobs += 1
        event = queued(f"j{self.jobs}", shape, tenant, priority)
        self.queued[event.job_id] = event
        self.state.on_queued(event)

    def running(self, pick: int) -> JobId | None:
        ids = sorted(self.state.running)
        return ids[pick % len(ids)] if ids else None

    def finish(self, pick: int) -> None:
        job_id = self.running(pick)
        if job_id is not None:
            attempt = self.state.running_attempt[job_id]
            ran = float(30 * (pick % 7))
            self.state.on_finished(
                JobFinished(job_id=job_id, outcome=Outcome.SUCCEEDED, attempt=attempt, ran_s=ran)
            )

    def end_and_requeue(self, pick: int, failed: bool, backoff: float, late: bool = False) -> None:
        """A run preempted or failed, and the queue requeueing it (maybe with a backoff); with
        `late`, the requeue is read before the event that ends the run (topics are not ordered
        with each other), so what the run served arrives while the job is pending."""
        job_id = self.running(pick)
        if job_id is None:
            return
        attempt = self.state.running_attempt[job_id]
        cluster = self.state.running[job_id].cluster
        kind, reason, message, ran = (
            (RunFailed, "application_error", "exit 1", 20 * (pick % 4))
            if failed
            else (JobPreempted, "node_failed", "gone", 45 * (pick % 5))
        )
        ended = kind(
            job_id=job_id,
            attempt=attempt,
            cluster=cluster,
            reason_code=reason,
            message=message,
            ran_s=float(ran),
        )
        if not late:
            self.state.on_preempted(ended)
        first = self.queued[job_id]
        later = datetime.fromtimestamp(self.now + backoff, UTC) if backoff else None
        again = first.model_copy(
            update={"attempt": attempt, "requeue_of_attempt": attempt, "not_before": later}
        )
        self.state.on_queued(again)
        if late:
            self.state.on_preempted(ended)

    def refuse(self, pick: int) -> None:
        job_id = self.running(pick)
        if job_id is not None:
            self.state.on_refused(
                PlacementRefused(
                    job_id=job_id,
                    attempt=self.state.running_attempt[job_id],
                    epoch=self.state.running_epoch[job_id],
                    cluster="c1",
                    reason_code="would_overcommit",
                    message="no room",
                )
            )

    def foreign_placement(self, pick: int, node: int) -> None:
        """Another (older) leader's placement of a pending job, read from the log."""
        ids = sorted(self.state.pending)
        if not ids:
            return
        job_id = ids[pick % len(ids)]
        job = self.state.pending[job_id]
        nodes = sorted(self.state.nodes)
        chosen = self.state.nodes[nodes[node % len(nodes)]]
        if node >= 9:
            # A node the inventory no longer lists (it left while the placement was on its
            # way): nothing is charged for it, in the kept state as in a rebuild.
            chosen = replace(chosen, node_id=NodeId(f"{chosen.node_id}-gone"))
        # Every leader names the devices each replica takes (perhaps ones ours holds: a
        # deposed leader's view); a replica larger than the node cannot name them, and a
        # leader would not place it there.
        per = round(job.accelerators) if job.accelerators >= 1 else 1
        if job.accelerators > 0 and per > chosen.accelerators:
            return
        event = PlacementDecided(
            job_id=job_id,
            attempt=self.state.next_attempt(job_id),
            epoch=1,
            leader="l0",
            cluster=chosen.cluster,
            accelerator_type=chosen.accelerator.type,
            spec=self.queued[job_id].spec,
            replicas=[
                ReplicaAssignment(
                    replica=r,
                    node_id=chosen.node_id,
                    accelerators=job.accelerators,
                    cpu=job.cpu,
                    memory_gb=job.memory_gb,
                    devices=[(r * per + i) % chosen.accelerators for i in range(per)]
                    if job.accelerators > 0
                    else [],
                )
                for r in range(job.replicas)
            ],
        )
        self.state.on_placed(event, self.now)

    def preemption(self, pick: int, cancel: bool) -> None:
        job_id = self.running(pick)
        if job_id is None:
            return
        attempt = self.state.running_attempt[job_id]
        alloc = self.state.running[job_id]
        claim = WireClaim(rank=0, guaranteed=True)
        self.state.on_preemption_requested(
            PreemptionRequested(
                job_id=job_id,
                attempt=attempt,
                cluster=alloc.cluster,
                tenant=alloc.job.tenant,
                priority_class="low",
                claim=claim,
                for_job="x",
                for_tenant="nlp",
                for_priority_class="critical",
                for_claim=claim,
                reason_code="r",
                message="m",
                grace_s=0,
                epoch=1,
                leader="l1",
            )
        )
        if cancel:
            self.state.on_preemption_canceled(
                PreemptionCanceled(
                    job_id=job_id,
                    attempt=attempt,
                    for_job="x",
                    reason_code="min_runtime",
                    message="m",
                ),
                self.now,
            )

    def fleet_change(self, which: int) -> None:
        if which == 0:
            self.state.on_capacity(capacity("c2", "T4", 2, 2))  # a node leaves
        elif which == 1:
            self.state.on_capacity(capacity("c2", "T4", 4, 2))  # nodes join
        else:
            self.state.on_capacity(capacity("c1", "H100", 4, 8))  # the same inventory again

    def health(self, node: int, healthy: bool) -> None:
        nodes = sorted(self.state.nodes)
        self.state.on_node_health(nodes[node % len(nodes)], healthy)


STEP = st.one_of(
    st.tuples(
        st.just("arrive"),
        st.integers(0, len(SHAPES) - 1),
        st.sampled_from(["vision", "nlp"]),
        st.sampled_from(["low", "low", "critical"]),
    ),
    st.tuples(st.just("cycle")),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(
        st.just("requeue"),
        st.integers(0, 50),
        st.booleans(),
        st.sampled_from([0, 5]),
        st.booleans(),
    ),
    st.tuples(st.just("refuse"), st.integers(0, 50)),
    st.tuples(st.just("foreign"), st.integers(0, 50), st.integers(0, 10)),
    st.tuples(st.just("preempt"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("fleet"), st.integers(0, 2)),
    st.tuples(st.just("health"), st.integers(0, 10), st.booleans()),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 10.0])),
    st.tuples(st.just("publish_gap"), st.lists(st.deferred(lambda: STEP), max_size=4)),
    st.tuples(st.just("lost_lease")),
    st.tuples(st.just("read_back")),
    st.tuples(st.just("budget"), st.sampled_from(["vision", "nlp"]), st.sampled_from([0.5, 0.25])),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=5, max_size=60), lose=st.lists(st.booleans(), max_size=4))
def test_the_kept_working_set_equals_a_rebuilt_one(
    steps: list[tuple[Any, ...]], lose: list[bool]
) -> None:
    world = World(lose)
    play(world, steps)
    world.run_cycle()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=5, max_size=60))
def test_cycles_on_the_fast_path_between_explanations_decide_the_same(
    steps: list[tuple[Any, ...]],
) -> None:
    """A leader that explains only in its first cycle (and on the fast path after) makes
    every decision of one that explains in every cycle (services/scheduler/cycle.py,
    EXPLAIN_GAP_S), on the long-lived working set."""
    always, seldom = World([]), World([])
    seldom.cycle.explain_always_up_to = -1  # however few wait
    seldom.cycle.explain_gap_s = float("inf")
    for world in (always, seldom):
        play(world, [*steps, ("cycle",)])
    assert seldom.decided == always.decided
    # Not vacuous: after its first, every cycle of `seldom` was on the fast path (a cycle
    # dropped for a lost lease leaves the explanation owed, so the next one explains).
    dropped = sum(1 for step in steps if step[0] == "lost_lease")
    assert seldom.explaining <= 1 + dropped and always.explaining == len(always.decided)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=5, max_size=60), lose=st.lists(st.booleans(), max_size=4))
def test_own_placements_passed_by_unparsed_leave_the_state_as_parsing_them(
    steps: list[tuple[Any, ...]], lose: list[bool]
) -> None:
    skipping, parsing = World(lose), World(lose)
    parsing.parse_own = True
    for world in (skipping, parsing):
        play(world, [*steps, ("read_back",), ("cycle",)])
    assert skipping.decided == parsing.decided
    for f in fields(SchedulerState):
        if f.name not in {"touched", "dirty", "fleet_version", "own", "running"}:
            assert getattr(skipping.state, f.name) == getattr(parsing.state, f.name), f.name
    # A placement read during its cycle's publish starts at its envelope's time, the wall
    # clock's when each world built it: the one thing not compared.
    ours, theirs = skipping.state.running, parsing.state.running
    assert ours.keys() == theirs.keys()
    for job_id, alloc in ours.items():
        assert replace(alloc, start_time=0.0) == replace(theirs[job_id], start_time=0.0)


def play(world: World, steps: list[tuple[Any, ...]]) -> None:
    """Applies `steps` (drawn from STEP) to `world`."""
    for step in steps:
        kind, *args = step
        if kind == "arrive":
            world.arrive(*args)
        elif kind == "cycle":
            world.run_cycle()  # raises WorkingSetDrift on any difference
        elif kind == "finish":
            world.finish(*args)
        elif kind == "requeue":
            world.end_and_requeue(*args)
        elif kind == "refuse":
            world.refuse(*args)
        elif kind == "foreign":
            world.foreign_placement(*args)
        elif kind == "preempt":
            world.preemption(*args)
        elif kind == "fleet":
            world.fleet_change(*args)
        elif kind == "health":
            world.health(*args)
        elif kind == "publish_gap":
            world.cycle_with_events_during_publish(*args)
        elif kind == "lost_lease":
            world.cycle_losing_the_lease()
        elif kind == "read_back":
            world.read_back()
        elif kind == "budget":
            world.budget(*args)
        else:
            world.now += args[0]


def test_a_cycle_rebuilds_only_when_the_fleet_changes() -> None:
    world = World(lose=[])
    world.working.verify_every = 0  # count real rebuilds only
    for i in range(40):
        world.arrive(i % len(SHAPES), "vision", "low")
        world.run_cycle()
        if i % 3 == 0:
            world.finish(i)
    assert world.working.rebuilds == 1  # the first cycle
    world.fleet_change(2)  # the same inventory re-sent: nothing changed
    world.run_cycle()
    assert world.working.rebuilds == 1
    world.fleet_change(0)
    world.run_cycle()
    assert world.working.rebuilds == 2
    kept = world.working.state
    assert kept is not None
    from core.cycle import CycleState

    fresh = CycleState.from_snapshot(
        world.state.snapshot(world.now), POLICY, Levels(POLICY, world.state.history)
    )
    assert differences(kept, fresh) == []


def test_differences_names_what_drifted() -> None:
    """The check can fail: a job charged twice shows as a difference."""
    world = World(lose=[])
    world.working.verify_every = 0
    world.arrive(1, "vision", "low")
    world.run_cycle()
    kept = world.working.state
    assert kept is not None and kept.running
    from core.cycle import CycleState

    fresh = CycleState.from_snapshot(
        world.state.snapshot(world.now), POLICY, Levels(POLICY, world.state.history)
    )
    assert differences(kept, fresh) == []
    alloc = next(iter(kept.running.values()))
    kept.cap.release(alloc.replicas, alloc.job)  # capacity freed while the job still runs
    found = differences(kept, fresh)
    assert found and found[0].startswith("free_total")


def test_a_standby_drops_its_notes_past_a_bound_and_rebuilds() -> None:
    world = World(lose=[])
    world.working.verify_every = 0
    world.run_cycle()
    for _ in range(30):
        world.arrive(0, "vision", "low")  # read by a replica that does not decide
    world.working.bound(world.state, limit=50)
    assert len(world.state.touched) == 30 and world.working.state is not None
    world.working.bound(world.state, limit=20)
    assert world.state.touched == set() and world.working.state is None
    world.working.verify_every = 1  # the rebuilt state is right: checked strictly
    world.run_cycle()
    assert world.working.rebuilds == 2


def test_a_cycle_that_raises_half_way_rebuilds_next_time() -> None:
    """The notes of what changed are taken when a cycle starts: if bringing the kept state up
    to date raises half-way, the next cycle must rebuild rather than trust a half-synced state."""
    world = World(lose=[])
    for _ in range(3):
        world.arrive(1, "vision", "low")
    world.run_cycle()
    world.finish(0)
    world.arrive(1, "nlp", "low")
    calls = {"n": 0}
    queues = world.working.state.queues  # type: ignore[union-attr]
    add = queues.add

    def failing_add(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        raise RuntimeError("half-way")

    queues.add = failing_add  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="half-way"):
        world.run_cycle()
    queues.add = add  # type: ignore[method-assign]
    assert calls["n"] == 1 and world.working.state is None
    world.run_cycle()  # rebuilt, and checked strictly against a rebuild


@pytest.mark.parametrize(
    "change",
    [
        {"accelerator_types": ()},
        {"cpu": 7.0},
        {"memory_gb": 99.0},
        {"spread_group": "chat"},
    ],
    ids=lambda c: next(iter(c)),
)
def test_a_running_job_read_back_with_other_limits_is_counted_again(
    change: dict[str, Any],
) -> None:
    """A running job's allocation replaced by one on the same devices whose job differs in what
    the books count is not swapped in as equal: a job restricted to T4 holds a claim on T4 (the
    type-demand term reads it) and an unrestricted copy holds none; its CPU and memory are in
    its tenant's fair share; its spread group in the group's counts. The strict check of every
    cycle fails if the kept state keeps the old charges."""
    world = World(lose=[])
    job = spec(
        job_id="t4-only",
        tenant="vision",
        priority_class="low",
        resources={"accelerators": 1, "accelerator_types": ["T4"], "cpu": 2, "memory_gb": 8},
    )
    world.state.on_queued(
        JobQueued(job_id="t4-only", spec=job, submitted_at=datetime.fromtimestamp(NOW, UTC))
    )
    world.run_cycle()
    alloc = world.state.running[JobId("t4-only")]
    assert alloc.cluster == "c2"
    kept = world.working.state
    assert kept is not None and kept.cap.type_claimed_milli.sum() == 1000
    world.state.running[JobId("t4-only")] = replace(alloc, job=replace(alloc.job, **change))
    world.state.touched.add(JobId("t4-only"))
    world.run_cycle()  # checked strictly against a rebuild
    if "accelerator_types" in change:
        assert kept.cap.type_claimed_milli.sum() == 0
