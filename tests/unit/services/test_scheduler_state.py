"""The scheduler's event-built state: replays are idempotent and capacity comes back."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from bench.inventory import inventory
from core.service import MAX_SERVICE
from schemas.events import (
    ClusterCapacity,
    JobFinished,
    JobPreempted,
    JobQueued,
    Outcome,
    PlacementDecided,
    PlacementRefused,
    ReplicaAssignment,
    RunFailed,
)
from services.scheduler.handlers import SchedulerMetrics, apply_records
from services.scheduler.state import SchedulerState
from tests.unit.services.builders import T0, placement_record, spec


def capacity(nodes: int = 2) -> ClusterCapacity:
    return inventory(count=nodes)


def queued(job_id: str) -> JobQueued:
    return JobQueued(job_id=job_id, spec=spec(job_id=job_id), submitted_at=T0)


def placed(job_id: str, attempt: int = 1, epoch: int = 1) -> PlacementDecided:
    return PlacementDecided(
        job_id=job_id,
        attempt=attempt,
        epoch=epoch,
        leader="x",
        cluster="c1",
        accelerator_type="H100",
        spec=spec(job_id=job_id),
        replicas=[ReplicaAssignment(replica=0, node_id="n0", accelerators=1, cpu=1, memory_gb=1)],
    )


def test_capacity_builds_the_fleet_and_replaces_it() -> None:
    state = SchedulerState()
    state.on_capacity(capacity(3))
    state.on_capacity(capacity(2))
    assert sorted(state.nodes) == ["n0", "n1"]
    assert state.clusters["c1"].prices[("H100", "reserved")] == 2.0  # type: ignore[index]


def test_placement_moves_pending_to_running_once() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1"), 1.0)
    state.on_placed(placed("j1"), 2.0)  # our own decision, seen again on the feed
    assert list(state.running) == ["j1"] and state.pending == {}
    assert state.running["j1"].start_time == 1.0  # type: ignore[index]
    assert state.next_attempt("j1") == 2  # type: ignore[arg-type]


def test_refusal_returns_the_job_to_pending_and_frees_capacity() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1"), 1.0)
    state.dirty = False
    state.on_refused(
        PlacementRefused(
            job_id="j1",
            attempt=1,
            epoch=1,
            cluster="c1",
            reason_code="would_overcommit",
            message="full",
        )
    )
    assert list(state.pending) == ["j1"] and state.running == {} and state.dirty


def test_stale_refusal_is_ignored() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1", attempt=2), 1.0)
    state.on_refused(
        PlacementRefused(
            job_id="j1", attempt=1, epoch=1, cluster="c1", reason_code="x", message="y"
        )
    )
    assert list(state.running) == ["j1"]


def test_finished_job_is_never_resurrected_by_a_late_queued_event() -> None:
    state = SchedulerState()
    state.on_finished(JobFinished(job_id="j1", outcome=Outcome.CANCELED))
    state.on_queued(queued("j1"))
    assert state.pending == {}


def test_finishing_a_running_job_frees_it() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1"), 1.0)
    state.dirty = False
    state.on_finished(JobFinished(job_id="j1", attempt=1, outcome=Outcome.SUCCEEDED))
    assert state.running == {} and state.dirty


def test_an_unhealthy_node_stays_out_even_when_the_inventory_is_resent() -> None:
    state = SchedulerState()
    state.on_capacity(capacity(2))
    state.on_node_health("n1", healthy=False)
    state.on_capacity(capacity(2))
    assert not state.nodes["n1"].healthy and state.nodes["n0"].healthy  # type: ignore[index]
    state.dirty = False
    state.on_node_health("n1", healthy=True)
    assert state.nodes["n1"].healthy and state.dirty  # type: ignore[index]


def test_a_requeue_frees_the_ended_run_even_before_its_preempted_event() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1"), 1.0)
    requeue = JobQueued(
        job_id="j1",
        spec=spec(job_id="j1"),
        submitted_at=T0,
        attempt=1,
        requeue_of_attempt=1,
        excluded_nodes=["n0"],
    )
    state.on_queued(requeue)
    assert state.running == {} and list(state.pending) == ["j1"]
    assert state.pending["j1"].excluded_nodes == frozenset({"n0"})  # type: ignore[index]
    state.on_queued(queued("j1"))  # the original queueing, read late, changes nothing
    assert state.pending["j1"].excluded_nodes == frozenset({"n0"})  # type: ignore[index]


def test_preempted_frees_only_the_run_it_names() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1", attempt=2), 1.0)
    state.on_preempted(
        JobPreempted(job_id="j1", attempt=1, cluster="c1", reason_code="x", message="m")
    )
    assert list(state.running) == ["j1"]
    state.on_preempted(
        JobPreempted(job_id="j1", attempt=2, cluster="c1", reason_code="x", message="m")
    )
    assert state.running == {} and state.pending == {}  # the queue decides what comes next


def test_a_used_up_deprioritize_budget_lowers_the_tenant_weight_for_its_month() -> None:
    from schemas.usage import BudgetExceeded, BudgetUnit, Enforcement

    def exceeded(pct: float, project: str | None = None) -> BudgetExceeded:
        return BudgetExceeded(
            budget_id="b",
            tenant="vision",
            project=project,
            month="2026-01",
            unit=BudgetUnit.ACCELERATOR_HOURS,
            limit=10,
            used=10,
            threshold_pct=pct,
            enforcement=Enforcement.DEPRIORITIZE,
            weight_factor=0.5,
            crossed_at=T0,
            message="m",
        )

    state = SchedulerState()
    state.on_budget(exceeded(80))  # a warning threshold changes nothing
    state.on_budget(exceeded(100, project="p"))  # shares are per tenant, not project
    assert state.weight_factors("2026-01") == {}
    state.on_budget(exceeded(100))
    assert state.weight_factors("2026-01") == {"vision": 0.5}
    assert state.weight_factors("2026-02") == {}


def test_a_refusal_read_before_its_placement_keeps_the_job_pending() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_refused(
        PlacementRefused(
            job_id="j1", attempt=1, epoch=1, cluster="c1", reason_code="x", message="y"
        )
    )
    state.on_placed(placed("j1"), 1.0)  # replayed late: that run never took capacity
    assert state.running == {} and list(state.pending) == ["j1"]
    assert state.next_attempt("j1") == 2  # type: ignore[arg-type]


def test_the_end_of_an_older_run_frees_nothing() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1", attempt=2), 1.0)
    state.on_finished(JobFinished(job_id="j1", attempt=1, outcome=Outcome.SUCCEEDED))
    assert list(state.running) == ["j1"]


def refused(job_id: str, attempt: int, epoch: int) -> PlacementRefused:
    return PlacementRefused(
        job_id=job_id,
        attempt=attempt,
        epoch=epoch,
        cluster="c1",
        reason_code="stale_epoch",
        message="old leader",
    )


def test_a_placement_read_before_its_queued_event_is_applied_when_that_arrives() -> None:
    """On a replay placement.decided can be read before job.queued; the job is running, not
    pending, or the new leader would place it a second time."""
    state = SchedulerState()
    state.on_placed(placed("j1"), 1.0)
    assert state.running == {} and state.pending == {}
    state.on_queued(queued("j1"))
    assert list(state.running) == ["j1"] and state.pending == {}
    assert state.running["j1"].start_time == 1.0  # type: ignore[index]
    assert state.next_attempt("j1") == 2  # type: ignore[arg-type]


@pytest.mark.parametrize("refusal_first", [True, False])
def test_both_leaders_copies_read_before_the_queued_event_leave_the_newer_running(
    refusal_first: bool,
) -> None:
    """A replay reads the deposed leader's copy (epoch 1, refused) and its successor's (epoch
    2) of one attempt before the job's job.queued: the successor's copy is the run."""
    state = SchedulerState()
    state.on_placed(placed("j1", epoch=1), 1.0)
    state.on_placed(placed("j1", epoch=2), 2.0)
    if refusal_first:
        state.on_refused(refused("j1", attempt=1, epoch=1))
    state.on_queued(queued("j1"))
    if not refusal_first:
        state.on_refused(refused("j1", attempt=1, epoch=1))
    assert list(state.running) == ["j1"] and state.pending == {}
    assert state.running_epoch["j1"] == 2  # type: ignore[index]


def test_an_early_placement_of_a_finished_job_is_forgotten() -> None:
    state = SchedulerState()
    state.on_placed(placed("j1"), 1.0)
    state.on_finished(JobFinished(job_id="j1", attempt=1, outcome=Outcome.SUCCEEDED))
    state.on_queued(queued("j1"))
    assert state.running == {} and state.pending == {} and state.early == {}


def test_refusing_a_deposed_leaders_copy_of_an_attempt_leaves_ours_running() -> None:
    """A deposed leader (epoch 1) and its successor (epoch 2) both placed attempt 1; the
    executor refuses the old one for its epoch, and that refusal must not free ours."""
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1", epoch=2), 1.0)
    state.on_placed(placed("j1", epoch=1), 1.5)  # the late one, read after ours
    state.on_refused(refused("j1", attempt=1, epoch=1))
    assert list(state.running) == ["j1"] and state.pending == {}
    state.on_finished(JobFinished(job_id="j1", attempt=1, outcome=Outcome.SUCCEEDED))
    assert state.running == {} and "j1" in state.finished  # the attempt was not closed


@pytest.mark.parametrize("refusal_first", [True, False])
def test_the_deposed_leader_follows_its_successors_copy_of_an_attempt(
    refusal_first: bool,
) -> None:
    """The deposed leader's own view: it placed attempt 1 (epoch 1), stalled, and its
    successor placed attempt 1 again (epoch 2) on other nodes. Whichever it reads first, the
    refusal of its copy or the successor's placement, it ends up holding the successor's run,
    and that run's end ends the job: it must not place the job again (a second run)."""
    state = SchedulerState()
    state.on_capacity(capacity(2))
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1", epoch=1), 1.0)
    successor = placed("j1", epoch=2)
    successor.replicas[0].node_id = "n1"
    if refusal_first:
        state.on_refused(refused("j1", attempt=1, epoch=1))
        assert list(state.pending) == ["j1"]
        state.on_placed(successor, 2.0)
    else:
        state.on_placed(successor, 2.0)
        state.on_refused(refused("j1", attempt=1, epoch=1))
    assert state.pending == {} and state.running_epoch["j1"] == 2  # type: ignore[index]
    assert state.running["j1"].replicas[0].node_id == "n1"  # type: ignore[index]
    state.on_finished(JobFinished(job_id="j1", attempt=1, outcome=Outcome.SUCCEEDED))
    assert state.running == {} and state.pending == {} and "j1" in state.finished


def test_refusing_the_placement_we_hold_frees_it() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1", epoch=1), 1.0)  # read in catch-up; the executor then fenced
    state.on_refused(refused("j1", attempt=1, epoch=1))
    assert state.running == {} and list(state.pending) == ["j1"]
    assert state.next_attempt("j1") == 2  # type: ignore[arg-type]


def test_fences_count_per_partition() -> None:
    state = SchedulerState()
    parts = [("placement.decided", 0), ("placement.decided", 1)]
    state.on_fence("placement.decided", 0, 3)
    assert not state.fenced(parts, 3)
    state.on_fence("placement.decided", 1, 4)  # a newer leader's fence counts too
    assert state.fenced(parts, 3) and not state.fenced(parts, 4)
    assert state.newest_epoch() == 4
    state.on_placed(placed("j9", epoch=6), 1.0)  # a placement's epoch counts as well
    assert state.newest_epoch() == 6


def test_a_placement_read_after_its_jobs_end_leaves_nothing_behind() -> None:
    """A replay can read job.finished before the placement.decided it follows: the placement
    must not leave an attempt count behind (a snapshot-resumed replica would not have it)."""
    state = SchedulerState()
    state.on_queued(queued("j1"))
    state.on_finished(JobFinished(job_id="j1", outcome=Outcome.SUCCEEDED, attempt=1))
    state.on_placed(placed("j1"), 1.0)
    assert state.attempts == {} and state.running == {} and state.pending == {}


def test_a_job_refused_again_is_held_back_longer_each_time() -> None:
    """The first refusal is retried at once; each later one holds the job back twice as long
    (from the refusal's time), so a cluster that keeps refusing it sees no place/refuse loop."""
    state = SchedulerState()
    state.on_queued(queued("j1"))
    waits = []
    for attempt in range(1, 6):
        state.on_placed(placed("j1", attempt=attempt), 100.0)
        refusal = refused("j1", attempt=attempt, epoch=1)
        refusal.reason_code = "unschedulable"
        state.on_refused(refusal, 100.0)
        assert list(state.pending) == ["j1"]
        waits.append(state.held.get("j1", 100.0) - 100.0)  # type: ignore[call-overload]
    assert waits == [0.0, 0.5, 1.0, 2.0, 4.0]
    assert state.backing_off(103.0) == {"j1": 104.0} and state.backing_off(104.0) == {}


def test_a_deposed_leaders_refusals_hold_nothing_back() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    for attempt in (1, 2):
        state.on_placed(placed("j1", attempt=attempt), 100.0)
        state.on_refused(refused("j1", attempt=attempt, epoch=1), 100.0)
    assert "j1" not in state.held


def test_a_requeued_job_starts_its_refusal_count_afresh() -> None:
    state = SchedulerState()
    state.on_queued(queued("j1"))
    for attempt in (1, 2, 3):
        state.on_placed(placed("j1", attempt=attempt), 100.0)
        refusal = refused("j1", attempt=attempt, epoch=1)
        refusal.reason_code = "unschedulable"
        state.on_refused(refusal, 100.0)
    assert state.held["j1"] == 101.0  # type: ignore[index]
    # Attempt 4 runs, is preempted and requeued much later: its first refusal is retried at
    # once, as any job's.
    state.on_placed(placed("j1", attempt=4), 200.0)
    state.on_queued(
        JobQueued(
            job_id="j1", spec=spec(job_id="j1"), submitted_at=T0, attempt=5, requeue_of_attempt=4
        )
    )
    state.on_placed(placed("j1", attempt=5), 300.0)
    refusal = refused("j1", attempt=5, epoch=1)
    refusal.reason_code = "unschedulable"
    state.on_refused(refusal, 300.0)
    assert state.held.get("j1", 0.0) <= 300.0  # type: ignore[call-overload]


def test_service_is_counted_once_per_run_and_learned_when_the_job_ends() -> None:
    state = SchedulerState(time_scale=1.0)
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1"), 100.0)
    # The requeue is read before the job.preempted that says how long the run was.
    requeue = JobQueued(
        job_id="j1", spec=spec(job_id="j1"), submitted_at=T0, attempt=1, requeue_of_attempt=1
    )
    state.on_queued(requeue)
    ended = JobPreempted(
        job_id="j1", attempt=1, cluster="c1", reason_code="x", message="m", ran_s=40.0
    )
    state.on_preempted(ended)
    state.on_preempted(ended)  # redelivered
    accelerators = state.pending["j1"].total_accelerators  # type: ignore[index]
    assert state.served["j1"] == (frozenset({1}), 40.0 * accelerators)  # type: ignore[index]
    assert state.attained(500.0).get("j1") == 40.0 * accelerators  # type: ignore[arg-type]
    state.on_placed(placed("j1", attempt=2), 1000.0)
    # While it runs: what it served, plus the run so far (fleet seconds).
    assert state.attained(1010.0)["j1"] == 50.0 * accelerators  # type: ignore[index]
    # The schema refuses a NaN; one built past it (as a replayed old record might be) too.
    nan = JobPreempted.model_construct(
        job_id="j1", attempt=3, cluster="c1", reason_code="x", message="m", ran_s=float("nan")
    )
    state.on_finished(JobFinished(job_id="j1", outcome=Outcome.SUCCEEDED, attempt=2, ran_s=60.0))
    state.on_preempted(nan)  # read after the end: nothing
    assert "j1" not in state.served
    (kind,) = [v for k, v in state.history.export().items() if k.startswith("k")]
    assert kind[0] == [100.0 * accelerators]


def test_run_ends_read_in_any_order_each_count_once() -> None:
    """The failure of attempt 2 read before the preemption of attempt 1: both runs count."""
    state = SchedulerState(time_scale=1.0)
    state.on_queued(queued("j1"))
    state.on_placed(placed("j1", attempt=2), 1.0)
    accelerators = state.running["j1"].job.total_accelerators  # type: ignore[index]
    failed = RunFailed(
        job_id="j1", attempt=2, cluster="c1", reason_code="x", message="m", ran_s=30.0
    )
    first = JobPreempted(
        job_id="j1", attempt=1, cluster="c1", reason_code="x", message="m", ran_s=1000.0
    )
    for event in (failed, first, failed, first):  # and each redelivered
        state.on_preempted(event)
    assert state.served_total("j1") == 1030.0 * accelerators  # type: ignore[arg-type]
    # More than any job could serve is capped, so sums and levels stay finite. (The wire
    # refuses a run of more than a decade, schemas.bounds.MAX_RUN_S; the cap holds anyway.)
    huge = JobPreempted.model_construct(
        job_id="j1", attempt=3, cluster="c1", reason_code="x", message="m", ran_s=1e300
    )
    state.on_preempted(huge)
    assert state.served_total("j1") == MAX_SERVICE  # type: ignore[arg-type]


def test_the_feed_reads_a_placement_without_its_spec() -> None:
    """The state takes a placed job from its job.queued: of the placement's spec only its head
    is read (the part the other followers of placements read), so a spec the executor would
    refuse is not parsed here (the executor's refusal frees the job)."""
    state = SchedulerState()
    state.on_capacity(capacity())
    state.on_queued(queued("j1"))
    metrics = SchedulerMetrics(CollectorRegistry())
    not_a_whole_spec = {"tenant": "vision", "kind": "no-such-kind", "replicas": 0}
    apply_records(state, [placement_record(placed("j1"), not_a_whole_spec)], metrics)
    assert list(state.running) == ["j1"] and state.pending == {}
    assert metrics.skipped._value.get() == 0
    # A spec without even its head is still unreadable.
    apply_records(state, [placement_record(placed("j2"), {"kind": "training"})], metrics)
    assert metrics.skipped._value.get() == 1
