"""Learned service levels (core/service.py): the Gittins effort against a plain recount, levels
from a kind's history, the order they give pending jobs, and the preemptions they allow."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from core.cycle import decide
from core.errors import PolicyError
from core.model import JobId
from core.ordering import PendingQueues
from core.policy import LevelMode, OrderingMode, Policy, ServiceLevels
from core.reasons import ReasonCode
from core.service import MAX_SERVICE, PER_KIND, Levels, ServiceHistory, gittins_effort
from core.state import CycleState
from tests.unit.core.builders import gpu_nodes, job, running, snapshot

LEARNED = replace(
    Policy.from_dict({"preemption": {"min_runtime_s": 0}}),
    service_levels=ServiceLevels(mode=LevelMode.LEARNED, min_samples=4),
)


def summary(samples: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(samples)
    prefix = [0.0]
    for value in ordered:
        prefix.append(prefix[-1] + value)
    return ordered, prefix


def recount(samples: list[float], attained: float) -> float | None:
    """The definition, term by term: for each quantum d up to a longer sample, the expected
    work min(S - a, d) over the jobs still running at a, divided by the share that ends."""
    alive = [s for s in samples if s > attained]
    if not alive:
        return None
    best = math.inf
    for edge in alive:
        d = edge - attained
        ended = sum(1 for s in alive if s - attained <= d) / len(alive)
        work = sum(min(s - attained, d) for s in alive) / len(alive)
        best = min(best, work / ended)
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=40),
    st.floats(0, 1e6, allow_nan=False),
)
def test_gittins_effort_matches_the_definition(samples: list[float], attained: float) -> None:
    got = gittins_effort(*summary(samples), attained)
    want = recount(samples, attained)
    if want is None:
        assert got is None
    else:
        assert got == pytest.approx(want, rel=1e-9, abs=1e-6)


def test_a_mostly_short_kind_has_little_effort_until_its_jobs_outlive_it() -> None:
    samples, prefix = summary([100.0] * 9 + [100_000.0])
    fresh = gittins_effort(samples, prefix, 0.0)
    assert fresh is not None and fresh < 200  # nine in ten end after 100 s
    # Past 100 s only the long one is left: all of its remaining work per completion.
    assert gittins_effort(samples, prefix, 150.0) == pytest.approx(100_000.0 - 150.0)
    assert gittins_effort(samples, prefix, 200_000.0) is None


def learned(history: ServiceHistory) -> ServiceHistory:
    """What was recorded, learned from (as the next cycle would)."""
    history.refresh(now=0.0, every_s=0.0)
    return history


def history_of(tenant: str, accelerators: float, services: list[float]) -> ServiceHistory:
    history = ServiceHistory()
    for i, service in enumerate(services):
        history.record(job(accelerators, job_id=f"h{i}", tenant=tenant), service)
    return learned(history)


def short_and_long(short: str, long: str) -> ServiceHistory:
    """Eight 8-GPU jobs of `short` that took 600 accelerator-seconds, eight of `long` 4e6."""
    history = history_of(short, 8, [600.0] * 8)
    for i in range(8):
        history.record(job(8, job_id=f"l{i}", tenant=long), 4e6)
    return learned(history)


def test_levels_follow_each_kind_and_fall_back_to_tenant_then_everyone() -> None:
    history = history_of("quick", 1, [600.0] * 8)
    for i, service in enumerate([4e6] * 8):
        history.record(job(8, job_id=f"l{i}", tenant="slow"), service)
    levels = Levels(LEARNED, learned(history))
    quick, slow = job(1, tenant="quick"), job(8, tenant="slow")
    assert levels.level(quick, 0.0) == 0
    assert levels.level(slow, 0.0) >= 5
    # A kind with no history of its own borrows its tenant's: quick's 4-GPU jobs.
    assert levels.level(job(4, tenant="quick"), 0.0) == 0
    # A tenant with none borrows everyone's, half short and half long: a fresh job may well be
    # short (level 0); one that outlived the short half is expected to be long.
    assert levels.level(job(2, tenant="new"), 0.0) == 0
    assert levels.level(job(2, tenant="new"), 1000.0) == levels.level(slow, 1000.0) >= 5
    # Outliving its kind: levelled by what it attained.
    assert levels.level(quick, 1e7) == LEARNED.service_levels.levels - 1


def test_without_history_or_when_off_every_job_is_level_zero() -> None:
    assert Levels(LEARNED).level(job(8), 0.0) == 0
    history = history_of("t", 8, [4e6] * 8)
    assert Levels(Policy.default(), history).level(job(8, tenant="t"), 0.0) == 0
    assert not Levels(Policy.default()).active
    las = replace(Policy.default(), ordering=OrderingMode.LAS)
    assert Levels(las).level(job(8), 1e7) == len(las.las.thresholds)


def test_history_keeps_the_last_per_kind_and_refuses_nonsense() -> None:
    history = ServiceHistory()
    j = job(1, tenant="t")
    for value in (float("nan"), float("inf"), -1.0):
        history.record(j, value)
    assert history.kinds == {}
    history.record(job(0, tenant="t"), 5.0)  # asked for no accelerators: no history
    history.record(j, 1e300)  # counted as MAX_SERVICE, so sums stay finite
    assert history.kinds[("all",)].recent[0] == MAX_SERVICE
    for i in range(PER_KIND + 10):
        history.record(j, float(i))
    assert history.kind_for(j, 1) is None  # recorded, not yet learned from
    learned(history)
    (key, kind) = history.kind_for(j, 1) or (None, None)
    assert key == ("k", "t", "1") and kind is not None
    assert kind.recent[0] == 10.0 and len(kind.recent) == PER_KIND
    history.record(j, 7.0)  # recorded after the summary: the restored one lags as this one does
    saved = history.export()
    hostile = ([1.0, float("nan"), -2.0, 1e300], [3.0, 1.0], 9, 4)  # a summary out of order
    restored = ServiceHistory.restore({**saved, "all": hostile}, history.refreshed_at)
    assert restored.export()["k\x1ft\x1f1"] == saved["k\x1ft\x1f1"]
    assert restored.export()["all"] == ([1.0], [1.0], 9, 9)
    level = Levels(LEARNED, history).level(j, 50.0)
    assert Levels(LEARNED, restored).level(j, 50.0) == level


def test_hostile_amounts_never_break_a_level() -> None:
    history = history_of("t", 8, [1e300, 1e300, 1e300, 1e300])
    levels = Levels(LEARNED, history)
    top = LEARNED.service_levels.levels - 1
    for attained in (0.0, 1e14, 1e300, float("inf"), float("nan")):
        assert 0 <= levels.level(job(8, tenant="t"), attained) <= top


def state_with(history: ServiceHistory, snap_pending: list, snap_running: list) -> CycleState:  # type: ignore[type-arg]
    snap = snapshot(gpu_nodes(1), snap_pending, snap_running)
    return CycleState.from_snapshot(snap, LEARNED, Levels(LEARNED, history))


def test_a_job_of_a_short_kind_goes_before_an_older_one_of_a_long_kind() -> None:
    history = short_and_long("quick", "slow")
    waiting = [
        job(8, job_id="long", tenant="slow", submit=0),
        job(8, job_id="short", tenant="quick", submit=50),
    ]
    state = state_with(history, waiting, [])
    result = decide(state, LEARNED, now=100.0)
    assert [a.job.job_id for a in result.placements] == [JobId("short")]


def test_a_long_running_job_of_a_long_kind_yields_to_a_short_kind() -> None:
    history = short_and_long("quick", "slow")
    veteran = running(job(8, job_id="veteran", tenant="slow"), "c1-n-0000", start=0)
    state = state_with(history, [job(8, job_id="short", tenant="quick", submit=50)], [veteran])
    state.attained = {JobId("veteran"): 8 * 3600.0}
    (decision,) = decide(state, LEARNED, now=3600.0).preemptions
    assert decision.victims[0].reason is ReasonCode.PREEMPTED_ATTAINED_SERVICE
    # The same jobs with levels off: nobody yields.
    off = replace(LEARNED, service_levels=ServiceLevels())
    plain = CycleState.from_snapshot(
        snapshot(gpu_nodes(1), [job(8, job_id="short", tenant="quick")], [veteran]), off
    )
    assert not decide(plain, off, now=3600.0).preemptions


@pytest.mark.parametrize(
    ("veteran_attained", "gap", "yields"),
    [
        (4 * 14_400.0, 1, True),  # one level above: enough when the gap is 1
        (4 * 14_400.0, 2, False),  # the default asks for two
        (16 * 14_400.0, 2, True),
    ],
)
def test_jobs_past_their_kind_yield_to_each_other_only_across_the_gap(
    veteran_attained: float, gap: int, yields: bool
) -> None:
    """Two jobs of one kind that both outlived its history (600 accelerator-seconds) are
    levelled by what they attained. A requeued one (14,400) takes a running one's place only
    when that one is `preempt_gap` levels above it, not as soon as it crosses the next edge,
    or such jobs would preempt each other in turn, each paying a checkpoint and a restart."""
    pol = replace(LEARNED, service_levels=replace(LEARNED.service_levels, preempt_gap=gap))
    history = history_of("t", 8, [600.0] * 8)
    veteran = running(job(8, job_id="veteran", tenant="t"), "c1-n-0000", start=0)
    back = job(8, job_id="back", tenant="t", submit=50)
    state = CycleState.from_snapshot(
        snapshot(gpu_nodes(1), [back], [veteran]), pol, Levels(pol, history)
    )
    state.attained = {JobId("veteran"): veteran_attained, JobId("back"): 14_400.0}
    decisions = decide(state, pol, now=10_000.0).preemptions
    assert [(d.for_job, d.victims[0].reason) for d in decisions] == (
        [(JobId("back"), ReasonCode.PREEMPTED_ATTAINED_SERVICE)] if yields else []
    )


@pytest.mark.parametrize(
    ("section", "error"),
    [
        ({"mode": "psychic"}, "service_levels.mode"),
        ({"base_s": float("nan")}, "service_levels.base_s"),
        ({"base_s": 0}, "service_levels.base_s"),
        ({"ratio": 1}, "service_levels.ratio"),
        ({"ratio": float("inf")}, "service_levels.ratio"),
        ({"levels": 0}, "service_levels.levels"),
        ({"min_samples": 1000}, "service_levels.min_samples"),
        ({"preempt_gap": 0}, "service_levels.preempt_gap"),
        ({"preempt_gap": 1.5}, "service_levels.preempt_gap"),
        ({"history": 10}, "unknown"),
    ],
)
def test_the_policy_section_refuses_what_would_break_levels(
    section: dict[str, object], error: str
) -> None:
    with pytest.raises(PolicyError, match=error):
        Policy.from_dict({"service_levels": section})


def test_the_policy_section_parses() -> None:
    pol = Policy.from_dict({"service_levels": {"mode": "learned", "base_s": 600, "levels": 4}})
    assert pol.service_levels == ServiceLevels(LevelMode.LEARNED, 600.0, 4.0, 4, 16, 3600.0)


def test_a_kept_queue_relevels_its_jobs_when_the_history_moves_on() -> None:
    history = ServiceHistory()
    levels = Levels(LEARNED, history)
    waiting = job(8, job_id="w", tenant="t")
    queues = PendingQueues.build([waiting], LEARNED, {}, levels)
    assert queues.tier(JobId("w")) == (-10, 0)  # no history yet: level 0
    for i in range(8):
        history.record(job(8, job_id=f"h{i}", tenant="t"), 4e6)
    learned(history)
    fresh = PendingQueues.build([waiting], LEARNED, {}, Levels(LEARNED, history))
    assert queues.tier(JobId("w")) != fresh.tier(JobId("w"))
    queues.relevel({})
    assert queues.tier(JobId("w")) == fresh.tier(JobId("w"))
    assert [j.job_id for j in queues.jobs()] == ["w"]


def test_an_unquoted_off_in_yaml_means_off() -> None:
    """YAML 1.1 reads `off` as false; the policy file says `mode: off` unquoted."""
    text = "service_levels: {mode: off}\nbackfill: {mode: off}\n"
    pol = Policy.from_dict(yaml.safe_load(text))
    assert pol.service_levels.mode is LevelMode.OFF
    assert pol.backfill.mode.value == "off"
    with pytest.raises(PolicyError, match=r"service_levels\.mode"):
        Policy.from_dict(yaml.safe_load("service_levels: {mode: on}"))


def test_a_tenant_inside_its_quota_goes_before_shorter_borrowed_work() -> None:
    """Under fair share, quota standing comes before the level (as in a preemption claim): a
    lender's long job is not left behind a borrower's shorter ones."""
    quotas = replace(
        Policy.from_dict(
            {
                "tenants": {
                    "lender": {"cohort": "c", "quotas": {"H100": 8}},
                    "borrower": {"cohort": "c", "quotas": {"H100": 0}},
                },
                "preemption": {"enabled": False},
            }
        ),
        service_levels=ServiceLevels(mode=LevelMode.LEARNED, min_samples=4),
    )
    history = short_and_long("borrower", "lender")
    waiting = [
        job(8, job_id="short", tenant="borrower", submit=0),
        job(8, job_id="long", tenant="lender", submit=50),
    ]
    snap = snapshot(gpu_nodes(1), waiting, [])
    levels = Levels(quotas, history)
    state = CycleState.from_snapshot(snap, quotas, levels)
    assert levels.level(waiting[0], 0.0) < levels.level(waiting[1], 0.0)
    result = decide(state, quotas, now=100.0)
    assert [a.job.job_id for a in result.placements] == [JobId("long")]


def test_jobs_that_no_level_can_help_leave_the_victim_searches_to_reclaim() -> None:
    """Learned levels with no history yet: four jobs of a tenant that could only borrow, ahead
    in order, must not use up the cycle's victim searches, or the tenant inside its quota
    never reclaims its share from the borrower."""
    pol = replace(
        Policy.from_dict(
            {
                "tenants": {
                    "a": {"cohort": "c", "quotas": {"H100": 12}},
                    "b": {"cohort": "c", "quotas": {"H100": 24}},
                    "z": {"cohort": "c", "quotas": {"H100": 0}},
                    "d": {"cohort": "c", "quotas": {"H100": 8}},
                },
                "preemption": {"min_runtime_s": 0},
            }
        ),
        service_levels=ServiceLevels(mode=LevelMode.LEARNED),
    )
    nodes = gpu_nodes(4)
    ids = list(nodes)
    busy = [
        running(job(8, job_id="a-run", tenant="a"), ids[0]),
        running(job(8, job_id="b-run1", tenant="b"), ids[1]),
        running(job(8, job_id="b-run2", tenant="b"), ids[2]),
        running(job(8, job_id="borrowed", tenant="z"), ids[3]),
    ]
    waiting = [job(8, job_id=f"a{i}", tenant="a", submit=i) for i in range(4)]
    waiting.append(job(8, job_id="owed", tenant="b", submit=10))
    state = CycleState.from_snapshot(snapshot(nodes, waiting, busy), pol)
    (decision,) = decide(state, pol, now=1000.0).preemptions
    assert decision.for_job == JobId("owed")
    assert [(v.job_id, v.reason) for v in decision.victims] == [
        (JobId("borrowed"), ReasonCode.RECLAIMED_BORROWED)
    ]
