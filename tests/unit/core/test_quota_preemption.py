"""Quotas and cohorts, fair-share and LAS ordering, reservations, and preemption decisions."""

from __future__ import annotations

import random
from dataclasses import replace

from core.cycle import CycleResult, schedule
from core.fairshare import ShareBook, accrue_rates, decay
from core.model import JobId, Snapshot, TenantId
from core.policy import Backfill, BackfillMode, OrderingMode, Policy
from core.reasons import ReasonCode
from tests.unit.core.builders import gang, gpu_nodes, job, running, snapshot


def policy(**tenants: dict[str, object]) -> Policy:
    return Policy.from_dict({"tenants": tenants, "preemption": {"min_runtime_s": 0}})


def run(snap: Snapshot, pol: Policy, now: float = 1000.0) -> CycleResult:
    return schedule(snap, pol, now=now, rng=random.Random(0))


def placed(result: CycleResult) -> set[str]:
    return {a.job.job_id for a in result.placements}


def test_quota_exhausted_without_cohort() -> None:
    pol = policy(a={"quotas": {"H100": 8}})
    result = run(
        snapshot(
            gpu_nodes(2),
            [job(8, job_id="one", tenant="a"), job(8, job_id="two", tenant="a", submit=1)],
        ),
        pol,
    )
    assert placed(result) == {"one"}
    assert result.pending["two"].codes[0] is ReasonCode.QUOTA_EXHAUSTED
    assert "belongs to no cohort" in result.pending["two"].message


def test_cohort_lends_idle_quota_within_limits() -> None:
    pol = policy(
        a={"cohort": "c", "quotas": {"H100": 8}, "borrow_limit": {"H100": 8}},
        b={"cohort": "c", "quotas": {"H100": 16}, "lend_limit": {"H100": 16}},
    )
    jobs = [job(8, job_id=f"a{i}", tenant="a", submit=i) for i in range(3)]
    result = run(snapshot(gpu_nodes(4), jobs), pol)
    assert placed(result) == {"a0", "a1"}
    assert result.pending["a2"].codes[0] is ReasonCode.BORROW_LIMIT


def test_nothing_to_lend_is_said_plainly() -> None:
    pol = policy(a={"cohort": "c", "quotas": {"H100": 8}}, b={"cohort": "c", "quotas": {"H100": 8}})
    busy = running(job(8, job_id="b-run", tenant="b"), "c1-n-0001")
    jobs = [job(8, job_id="a0", tenant="a"), job(8, job_id="a1", tenant="a", submit=1)]
    result = run(snapshot(gpu_nodes(4), jobs, [busy]), pol)
    assert placed(result) == {"a0"}
    assert "cohort c has nothing to lend" in result.pending["a1"].message


def test_reclaim_borrowed_capacity_for_tenant_under_quota() -> None:
    pol = policy(a={"cohort": "c", "quotas": {"H100": 8}}, b={"cohort": "c", "quotas": {"H100": 8}})
    own = running(job(8, job_id="b-own", tenant="b"), "c1-n-0000", start=0)
    lent = running(job(8, job_id="b-lent", tenant="b"), "c1-n-0001", start=10)
    result = run(snapshot(gpu_nodes(2), [job(8, job_id="a0", tenant="a")], [own, lent]), pol)
    (decision,) = result.preemptions
    assert decision.for_job == "a0"
    assert [(v.job_id, v.reason) for v in decision.victims] == [
        ("b-lent", ReasonCode.RECLAIMED_BORROWED)
    ]
    assert ReasonCode.AWAITING_PREEMPTION in result.pending["a0"].codes


def test_priority_preemption_takes_least_work_lost() -> None:
    pol = policy()
    old = running(job(8, job_id="old", priority="low"), "c1-n-0000", start=0)
    new = running(job(8, job_id="new", priority="low"), "c1-n-0001", start=900)
    result = run(
        snapshot(gpu_nodes(2), [job(8, job_id="urgent", priority="high")], [old, new]), pol
    )
    (decision,) = result.preemptions
    assert [(v.job_id, v.reason) for v in decision.victims] == [
        ("new", ReasonCode.PREEMPTED_FOR_PRIORITY)
    ]


def test_no_preemption_of_equal_claim_or_without_permission() -> None:
    pol = policy()
    busy = running(job(8, job_id="peer", priority="normal"), "c1-n-0000")
    low = running(job(8, job_id="low", priority="low"), "c1-n-0001")
    # "normal" may not preempt (preempting: false), and "peer" has an equal claim.
    result = run(snapshot(gpu_nodes(2), [job(8, job_id="n", priority="normal")], [busy, low]), pol)
    assert result.preemptions == ()


def test_young_and_non_preemptible_jobs_are_spared() -> None:
    pol = Policy.from_dict({"preemption": {"min_runtime_s": 600}})
    young = running(job(8, job_id="young", priority="low"), "c1-n-0000", start=900)
    firm = running(job(8, job_id="firm", priority="low", preemptible=False), "c1-n-0001")
    result = run(snapshot(gpu_nodes(2), [job(8, job_id="u", priority="high")], [young, firm]), pol)
    assert result.preemptions == ()


def test_fair_share_puts_heavy_past_user_behind() -> None:
    pol = policy(a={}, b={})
    jobs = [job(8, job_id="a0", tenant="a", submit=0), job(8, job_id="b0", tenant="b", submit=5)]
    heavy_a = snapshot(gpu_nodes(1), jobs, usage={"a": 1e9})
    assert placed(run(heavy_a, pol)) == {"b0"}
    assert placed(run(snapshot(gpu_nodes(1), jobs), pol)) == {"a0"}


def test_fair_share_counts_accelerators_by_their_speed() -> None:
    """Four H100s (relative speed 3) are more of the fleet than four L4s (0.5), though each is
    half of its type: the tenant on the slow devices goes first."""
    pol = policy(fast={}, slow={})
    nodes = gpu_nodes(1, type="H100", prefix="h") | gpu_nodes(1, type="L4", prefix="l")
    held = [
        running(job(4, job_id="f-run", tenant="fast", types=("H100",)), "c1-h-0000"),
        running(job(4, job_id="s-run", tenant="slow", types=("L4",)), "c1-l-0000"),
    ]
    jobs = [
        job(4, job_id="f-next", tenant="fast", types=("H100",), submit=0),
        job(4, job_id="s-next", tenant="slow", types=("H100",), submit=5),
    ]
    assert placed(run(snapshot(nodes, jobs, held), pol)) == {"s-next"}


def test_fair_share_alternates_tenants_within_a_cycle() -> None:
    pol = policy(a={}, b={})
    jobs = [job(8, job_id=f"a{i}", tenant="a", submit=i) for i in range(3)]
    jobs += [job(8, job_id=f"b{i}", tenant="b", submit=10 + i) for i in range(3)]
    assert placed(run(snapshot(gpu_nodes(2), jobs), pol)) == {"a0", "b0"}


def test_las_prefers_least_attained_service() -> None:
    pol = replace(Policy.default(), ordering=OrderingMode.LAS)
    jobs = [job(8, job_id="veteran", submit=0), job(8, job_id="fresh", submit=5)]
    snap = replace(snapshot(gpu_nodes(1), jobs), attained={JobId("veteran"): 1e7})
    assert placed(run(snap, pol)) == {"fresh"}


def test_las_preempts_the_most_served_job() -> None:
    pol = replace(Policy.from_dict({"preemption": {"min_runtime_s": 0}}), ordering=OrderingMode.LAS)
    served = running(job(8, job_id="served"), "c1-n-0000", start=0)
    snap = replace(
        snapshot(gpu_nodes(1), [job(8, job_id="fresh")], [served]),
        attained={JobId("served"): 1e7},
    )
    (decision,) = run(snap, pol).preemptions
    assert decision.victims[0].reason is ReasonCode.PREEMPTED_ATTAINED_SERVICE


def test_reservation_blocks_backfill_that_could_delay_the_gang() -> None:
    pol = replace(
        Policy.from_dict({"preemption": {"enabled": False}}),
        backfill=Backfill(BackfillMode.RESERVE, max_reservations=1, min_reserved_accelerators=16),
    )
    busy = running(job(4, job_id="r", max_runtime_s=3600), "c1-n-0000", start=0)
    big = gang(2, job_id="big", submit=0)
    unbounded = job(4, job_id="unbounded", submit=1)
    short = job(4, job_id="short", submit=2, max_runtime_s=600)
    result = run(snapshot(gpu_nodes(2), [big, unbounded, short], [busy]), pol)
    assert placed(result) == {"short"}
    assert result.pending["unbounded"].codes[0] is ReasonCode.CAPACITY_RESERVED


def test_strict_fifo_blocks_the_line() -> None:
    pol = replace(Policy.default(), ordering=OrderingMode.FIFO, backfill=Backfill(BackfillMode.OFF))
    busy = running(job(4, job_id="r"), "c1-n-0000")
    result = run(
        snapshot(gpu_nodes(1), [job(8, job_id="head"), job(1, job_id="small", submit=1)], [busy]),
        pol,
    )
    assert result.placements == ()
    assert result.pending["small"].codes[0] is ReasonCode.HEAD_OF_LINE_BLOCKED


def test_usage_decays_by_half_life() -> None:
    assert decay(100.0, 3600.0, 3600.0) == 50.0
    usage = accrue_rates({"a": 100.0}, {"a": 2.0}, 10.0, 3600.0)  # type: ignore[dict-item]
    assert 119.0 < usage["a"] < 120.0  # type: ignore[index]


def test_a_tenant_whose_jobs_all_left_holds_nothing_whatever_order_they_left_in() -> None:
    """0.3 + 1.0 + 0.1 - 0.3 - 1.0 - 0.1 is 8e-17 in floating point: left in the share book,
    a tenant holding nothing went after one that did not either, depending on the order its
    jobs left in (which followed the hash seed: a snapshot's restored state decided
    otherwise)."""
    pol = policy(vision={}, nlp={})
    book = ShareBook(
        totals={"accelerators": 16.0, "cpu": 64.0, "memory": 256.0},
        allocated={},
        past={},
        policy=pol,
        speeds={"H100": 1.0},
    )
    jobs = [job(0.3, job_id="a"), job(1, job_id="b"), job(0.1, job_id="c")]
    for j in jobs:
        book.charge(j, "H100")
    for j in jobs:
        book.charge(j, "H100", sign=-1.0)
    assert book.share(TenantId("vision")) == book.share(TenantId("nlp")) == 0.0
    assert book.rates() == {"vision": 0.0}
