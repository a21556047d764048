"""The preemptor's guards, grace cap, budget window and due timers, without any I/O."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.preemptor.guards import (
    Cancel,
    CancelReason,
    Hold,
    Ignore,
    JobFacts,
    Order,
    Request,
    Signal,
    Situation,
    decide_due,
    decide_request,
    grace_for,
    signals_in_window,
)
from tests.unit.preemptor.builders import (
    LIMITS,
    POLICY,
    T0,
    request,
    running,
    situation,
    wall,
)


def test_a_valid_request_signals_with_the_requested_grace() -> None:
    got = decide_request(request(grace_s=60), situation(), POLICY, LIMITS, T0)
    # 60 fleet seconds at 60x is one wall second.
    assert got == Signal(60, T0 + timedelta(seconds=1))


def test_grace_is_capped_by_the_policy() -> None:
    got = decide_request(request(grace_s=3600), situation(), POLICY, LIMITS, T0)
    assert got == Signal(120, T0 + timedelta(seconds=2))


@pytest.mark.parametrize(("asked", "granted"), [(0, 0), (30, 30), (120, 120), (121, 120), (-5, 0)])
def test_grace_for(asked: float, granted: float) -> None:
    assert grace_for(asked, LIMITS) == granted


REFUSALS = [
    ("stale epoch", request(epoch=4), situation(), CancelReason.STALE_EPOCH, "epoch 5 leads"),
    (
        "victim run ended",
        request(),
        situation(victim=replace(running(), ended_attempt=1)),
        CancelReason.VICTIM_GONE,
        "already ended",
    ),
    (
        "victim job ended by the queue (no attempt)",
        request(),
        situation(victim=replace(running(), finished=True, closed=True)),
        CancelReason.VICTIM_GONE,
        "already ended",
    ),
    (
        "a later run of the victim started",
        request(attempt=1),
        situation(victim=running(attempt=2)),
        CancelReason.VICTIM_GONE,
        "already ended",
    ),
    (
        "claim equal",
        request(for_claim=(0, False, 0)),
        situation(),
        CancelReason.CLAIM_NOT_HIGHER,
        "strictly higher claim",
    ),
    (
        "claim lower: borrowing asks a guaranteed victim of the same rank",
        request(
            claim=(10, True, 0),
            for_claim=(10, False, 0),
            reason_code="reclaimed_borrowed",
        ),
        situation(),
        CancelReason.CLAIM_NOT_HIGHER,
        "(rank 10, borrowing, level 0) is not higher",
    ),
    (
        "requester class may not preempt",
        request(for_priority_class="pushy", for_claim=(60, True, 0)),
        situation(),
        CancelReason.CLAIM_NOT_HIGHER,
        "not `preempting`",
    ),
    (
        "requester class does not outrank the victim's",
        request(priority_class="high", claim=(50, False, 0), for_claim=(50, True, 0)),
        situation(),
        CancelReason.CLAIM_NOT_HIGHER,
        "does not outrank",
    ),
    (
        "victim not preemptible",
        request(),
        situation(victim=replace(running(), preemptible=False)),
        CancelReason.NOT_PREEMPTIBLE,
        "preemptible: false",
    ),
    (
        "requester ended",
        request(),
        situation(requester=JobFacts("asker", finished=True, closed=True)),
        CancelReason.REQUESTER_GONE,
        "has ended",
    ),
    (
        "requester placed after the request",
        request(),
        situation(requester=JobFacts("asker", placed_at=T0 + timedelta(seconds=1))),
        CancelReason.REQUESTER_PLACED,
        "was placed after the request",
    ),
    (
        "min runtime",
        request(),
        situation(victim=running(ran_s=120)),
        CancelReason.MIN_RUNTIME,
        "has run 120 s of its guaranteed 600 s",
    ),
    (
        "tenant budget used up",
        request(),
        situation(tenant_signals=(T0 - wall(3000), T0 - wall(60))),
        CancelReason.TENANT_BUDGET,
        "already had 2 runs preempted in the last 3600 s",
    ),
]


@pytest.mark.parametrize(
    ("req", "sit", "reason", "says"),
    [r[1:] for r in REFUSALS],
    ids=[r[0] for r in REFUSALS],
)
def test_refusals(req: Request, sit: Situation, reason: CancelReason, says: str) -> None:
    got = decide_request(req, sit, POLICY, LIMITS, T0)
    assert isinstance(got, Cancel), got
    assert got.reason == reason
    assert says in got.message
    assert req.job_id in got.message  # every refusal names the job it spares


def test_a_higher_claim_for_reclaim_needs_no_preempting_class() -> None:
    # Reclaiming lent quota is not a priority preemption: the class rule does not apply.
    req = request(
        priority_class="normal",
        claim=(10, False, 0),
        for_priority_class="normal",
        for_claim=(10, True, 0),
        reason_code="reclaimed_borrowed",
    )
    assert isinstance(decide_request(req, situation(), POLICY, LIMITS, T0), Signal)


def test_attained_service_level_counts_in_the_claim() -> None:
    # Same rank and quota standing; the requester has attained less service (lower level).
    req = request(
        priority_class="normal",
        claim=(10, True, -2),
        for_priority_class="normal",
        for_claim=(10, True, -1),
        reason_code="preempted_attained_service",
    )
    assert isinstance(decide_request(req, situation(), POLICY, LIMITS, T0), Signal)


def test_a_request_for_a_run_in_hand_is_ignored() -> None:
    assert isinstance(decide_request(request(), situation(active=True), POLICY, LIMITS, T0), Ignore)


def test_a_stale_epoch_is_refused_even_when_the_run_is_in_hand() -> None:
    got = decide_request(request(epoch=3), situation(active=True), POLICY, LIMITS, T0)
    assert isinstance(got, Cancel) and got.reason == CancelReason.STALE_EPOCH


def test_a_placement_before_the_request_is_not_the_requester_running() -> None:
    # The requester ran before (an earlier attempt); that placement predates the request.
    req = request()
    sit = situation(requester=JobFacts("asker", placed_at=T0 - timedelta(minutes=5)))
    assert isinstance(decide_request(req, sit, POLICY, LIMITS, T0), Signal)


def test_an_unseen_victim_is_held_then_given_up() -> None:
    sit = situation(victim=JobFacts("victim"), received_at=T0)
    assert decide_request(request(), sit, POLICY, LIMITS, T0 + timedelta(seconds=29)) == Hold(
        T0 + timedelta(seconds=30)
    )
    late = decide_request(request(), sit, POLICY, LIMITS, T0 + timedelta(seconds=30))
    assert isinstance(late, Cancel) and late.reason == CancelReason.VICTIM_GONE
    assert "not seen running within 30 s" in late.message


def test_a_held_victim_seen_starting_is_judged_on_its_age() -> None:
    # Started 1 wall second ago: 60 fleet seconds, under the 600 s guarantee.
    at = T0 + timedelta(seconds=5)
    sit = situation(
        victim=JobFacts("victim", started_attempt=1, started_at=at - timedelta(seconds=1))
    )
    got = decide_request(request(), sit, POLICY, LIMITS, at)
    assert isinstance(got, Cancel) and got.reason == CancelReason.MIN_RUNTIME
    assert "has run 60 s" in got.message


def test_min_runtime_boundary() -> None:
    assert isinstance(
        decide_request(request(), situation(victim=running(ran_s=600)), POLICY, LIMITS, T0), Signal
    )
    assert isinstance(
        decide_request(request(), situation(victim=running(ran_s=599)), POLICY, LIMITS, T0), Cancel
    )


@pytest.mark.parametrize(
    ("ago_fleet_s", "counted"),
    [(0, 1), (60, 1), (3599, 1), (3600, 0), (7200, 0), (-60, 0)],
)
def test_budget_window_counts_fleet_seconds(ago_fleet_s: float, counted: int) -> None:
    # A window of 3600 fleet seconds is 60 wall seconds at 60x; signals "in the future" (a
    # skewed clock) do not count.
    assert signals_in_window([T0 - wall(ago_fleet_s)], T0, LIMITS) == counted


def test_budget_allows_up_to_the_limit() -> None:
    one = situation(tenant_signals=(T0 - wall(10),))
    assert isinstance(decide_request(request(), one, POLICY, LIMITS, T0), Signal)
    expired = situation(tenant_signals=(T0 - wall(4000), T0 - wall(5000), T0 - wall(10)))
    assert isinstance(decide_request(request(), expired, POLICY, LIMITS, T0), Signal)


DUE = [
    ("victim still running", running(), JobFacts("asker"), None),
    (
        "requester ended",
        running(),
        JobFacts("asker", finished=True, ended_attempt=1),
        CancelReason.REQUESTER_GONE,
    ),
    (
        "requester placed elsewhere",
        running(),
        JobFacts("asker", placed_at=T0 + timedelta(seconds=1)),
        CancelReason.REQUESTER_PLACED,
    ),
    (
        "victim finished during the grace",
        replace(running(), ended_attempt=1, finished=True),
        JobFacts("asker"),
        CancelReason.VICTIM_GONE,
    ),
    (
        "victim failed during the grace",
        replace(running(), ended_attempt=1),
        JobFacts("asker"),
        CancelReason.VICTIM_GONE,
    ),
]


@pytest.mark.parametrize(
    ("victim", "requester", "reason"), [d[1:] for d in DUE], ids=[d[0] for d in DUE]
)
def test_a_due_timer(victim: JobFacts, requester: JobFacts, reason: CancelReason | None) -> None:
    got = decide_due(request(), victim, requester)
    if reason is None:
        assert isinstance(got, Order)
        assert "victim" in got.message and "asker" in got.message
    else:
        assert isinstance(got, Cancel) and got.reason == reason


def test_an_earlier_run_ending_does_not_end_the_requested_run() -> None:
    victim = replace(running(attempt=2), ended_attempt=1)
    assert not victim.run_ended(2)
    assert victim.run_ended(1)


# --- facts merge in any order -------------------------------------------------------------

_times = st.one_of(st.none(), st.integers(0, 10_000).map(lambda s: T0 + timedelta(seconds=s)))
_facts = st.builds(
    lambda sa, at, ea, fin, closed, placed, pre: JobFacts(
        "j",
        started_attempt=sa,
        started_at=None if sa is None else T0 + timedelta(seconds=sa),
        ended_attempt=ea,
        finished=fin,
        closed=closed,
        placed_at=placed,
        preemptible=pre,
    ),
    st.one_of(st.none(), st.integers(0, 5)),
    _times,
    st.one_of(st.none(), st.integers(0, 5)),
    st.booleans(),
    st.booleans(),
    _times,
    st.one_of(st.none(), st.booleans()),
)


@given(st.lists(_facts, min_size=1, max_size=6), st.randoms())
def test_facts_merge_in_any_order(facts: list[JobFacts], rnd: random.Random) -> None:
    # preemptible is the only last-wins field; a job's spec never changes it between runs.
    facts = [replace(f, preemptible=facts[0].preemptible) for f in facts]
    shuffled = list(facts)
    rnd.shuffle(shuffled)

    def fold(items: list[JobFacts]) -> JobFacts:
        out = JobFacts("j")
        for f in items:
            out = out.merge(f)
        return out

    assert fold(facts) == fold(shuffled)
    assert fold(facts + facts) == fold(facts)  # redelivery changes nothing


def test_a_repack_moves_a_job_without_a_higher_claim_only_when_the_policy_allows() -> None:
    """A move (core/repack.py) takes no capacity from its job, so equal claims are fine; but
    only with `preemption.repack` on, and never for a job of a lower priority rank."""
    move = request(
        reason_code="repacked",
        priority_class="normal",
        claim=(10, True, 0),
        for_priority_class="normal",
        for_claim=(10, True, 0),
    )
    on = replace(POLICY, preemption=replace(POLICY.preemption, repack=True))
    assert isinstance(decide_request(move, situation(), on, LIMITS, T0), Signal)
    off = decide_request(move, situation(), POLICY, LIMITS, T0)
    assert isinstance(off, Cancel) and off.reason is CancelReason.CLAIM_NOT_HIGHER
    assert "preemption.repack is off" in off.message
    down = decide_request(replace(move, for_priority_class="low"), situation(), on, LIMITS, T0)
    assert isinstance(down, Cancel) and "lower priority class" in down.message
    # The other guards still hold: a move waits out the victim's minimum runtime too.
    young = situation(victim=running(ran_s=60))
    held = decide_request(move, young, on, LIMITS, T0)
    assert isinstance(held, Cancel) and held.reason is CancelReason.MIN_RUNTIME
