"""Folding lifecycle facts into runs: any arrival order, refusals, duplicates, the queue's
bookkeeping finishes, and billing open runs by the clock."""

from __future__ import annotations

import itertools

import pytest

from schemas.usage import TickKind
from services.meter.runs import Capacity, Phase, Refused, RunState, apply_facts, bill_open
from services.meter.ticks import MICRO as S
from tests.unit.meter.builders import T0, after, book, capacity, finished, grid, placed, started


def totals(ticks) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Accelerator-seconds and cost, in millionths."""
    return sum(t.accelerator_seconds_u for t in ticks), sum(t.cost_u for t in ticks)


@pytest.mark.parametrize("order", list(itertools.permutations(["placed", "started", "finished"])))
def test_any_arrival_order_meters_the_same_run(order: tuple[str, ...]) -> None:
    facts = {
        "placed": placed(),
        "started": started(at=after(15)),
        "finished": finished(ran_s="150"),
    }
    applied = apply_facts([facts[name] for name in order], {}, book(), grid())
    state = applied.states[("job-1", 1)]
    assert state.phase is Phase.CLOSED
    assert [t.kind for t in applied.ticks][-1] is TickKind.CLOSE
    assert totals(applied.ticks) == (1200 * S, 700_000)  # 8 x 150 s at 2.10 an hour
    assert applied.opened == 1 and applied.closed == 1
    assert {t.tenant for t in applied.ticks} == {"vision"}
    assert {t.project for t in applied.ticks} == {"detect"}


def test_a_run_stays_pending_until_placement_and_start_are_known() -> None:
    applied = apply_facts([started(), finished()], {}, book(), grid())
    assert applied.states[("job-1", 1)].phase is Phase.PENDING
    assert applied.ticks == []
    later = apply_facts([placed()], applied.states, book(), grid())
    assert later.states[("job-1", 1)].phase is Phase.CLOSED
    assert totals(later.ticks)[0] == 1200 * S


def test_a_refused_placement_is_forgotten_and_the_honoured_one_is_billed() -> None:
    facts = [
        placed(epoch=1, nodes={"h-0": 8}),
        placed(epoch=2, nodes={"h-1": 8}),
        Refused("job-1", 1, 1),
        started(nodes=("h-1",)),
    ]
    applied = apply_facts(facts, {}, book(), grid())
    state = applied.states[("job-1", 1)]
    assert state.phase is Phase.OPEN
    assert state.run is not None
    assert [(s.price_tier, s.unit_price_u) for s in state.run.shares] == [("on_demand", 4_500_000)]


def test_the_run_uses_the_placement_on_the_nodes_it_started_on() -> None:
    facts = [placed(epoch=2, nodes={"h-1": 8}), placed(epoch=1, nodes={"h-0": 8}), started()]
    state = apply_facts(facts, {}, book(), grid()).states[("job-1", 1)]
    assert state.run is not None and state.run.shares[0].price_tier == "reserved"


def test_a_gang_over_two_tiers_is_split_and_fractions_count() -> None:
    facts = [
        placed(nodes={"h-0": 8, "h-1": 0.5}),
        started(nodes=("h-0", "h-1")),
        finished(ran_s="3600"),
    ]
    applied = apply_facts(facts, {}, book(), grid())
    by_tier: dict[str, int] = {}
    for t in applied.ticks:
        by_tier[t.price_tier] = by_tier.get(t.price_tier, 0) + t.cost_u
    assert by_tier == {"reserved": 16_800_000, "on_demand": 2_250_000}


def test_the_queues_zero_second_finish_closes_nothing() -> None:
    open_ = apply_facts([placed(), started()], {}, book(), grid()).states
    bookkeeping = finished(ran_s="0", outcome="canceled", measured=False)
    applied = apply_facts([bookkeeping], open_, book(), grid())
    assert applied.states == {} and applied.ticks == []
    real = apply_facts([finished(ran_s="42", outcome="canceled")], open_, book(), grid())
    assert real.states[("job-1", 1)].phase is Phase.CLOSED
    assert totals(real.ticks)[0] == 8 * 42 * S


def test_a_second_end_or_a_late_placement_changes_a_closed_run_not() -> None:
    closed = apply_facts([placed(), started(), finished()], {}, book(), grid()).states
    again = apply_facts(
        [finished(ran_s="999"), placed(epoch=5), Refused("job-1", 1, 1)], closed, book(), grid()
    )
    assert again.ticks == [] and again.states == {}


def test_another_attempt_is_another_run() -> None:
    facts = [
        placed(attempt=1),
        started(attempt=1),
        finished(attempt=1, ran_s="60"),
        placed(attempt=2),
        started(attempt=2, at=after(600)),
        finished(attempt=2, ran_s="30"),
    ]
    applied = apply_facts(facts, {}, book(), grid())
    assert {t.run_id for t in applied.ticks} == {"job-1#1", "job-1#2"}
    assert totals(applied.ticks)[0] == 8 * 90 * S


def test_capacity_teaches_pools_with_their_tiers_and_prices() -> None:
    b = book()
    applied = apply_facts([Capacity(capacity())], {}, b, grid())
    pools = applied.pools["onprem-h100"]
    assert [(p.accelerator_type, p.price_tier, p.accelerators, p.unit_price_u) for p in pools] == [
        ("H100", "on_demand", 8, 4_500_000),
        ("H100", "reserved", 8, 2_100_000),
    ]


def test_unknown_prices_fall_back_to_the_policy_then_to_zero() -> None:
    b = book()
    assert b.price("cloud-a100", "A100", "spot") == 800_000  # the policy's fallback
    assert b.price("cloud-a100", "B200", "spot") == 0
    assert ("cloud-a100", "B200", "spot") in b.unpriced


def test_the_clock_bills_open_runs_and_holds_back_a_long_catch_up() -> None:
    g = grid(60)
    states = apply_facts([placed(), started(at=T0)], {}, book(), g).states
    first = g.index(g.virtual(T0))
    changed, ticks, held = bill_open(states.values(), first + 9, g, max_intervals=4)
    assert held and len(ticks) == 4 and [t.kind for t in ticks] == [TickKind.INTERVAL] * 4
    again, more, held = bill_open(changed, first + 9, g, max_intervals=100)
    assert not held and len(more) == 6
    assert all(isinstance(s, RunState) for s in again)
    assert totals(ticks + more)[0] == 8 * 600 * S


def test_a_run_reported_longer_than_can_have_passed_is_closed_at_the_latest_end() -> None:
    """A run time that cannot be (here ten days, five minutes after the start; a timestamp
    sent as a duration, 1.7e9 s, was 28 million one-minute intervals, all built at once) is
    cut at the latest end the meter believes; a run ending within it is billed as reported."""
    g = grid()
    latest = g.virtual(after(15 + 300))  # the meter's now: five minutes after the start
    facts = [placed(), started(at=after(15))]
    lied = apply_facts([*facts, finished(ran_s="864000")], {}, book(), g, latest)
    state = lied.states[("job-1", 1)]
    assert state.phase is Phase.CLOSED and state.cut and lied.cut == 1
    assert state.ran_u == 300 * S
    assert len(lied.ticks) <= 7  # the five or six intervals up to now, and the close
    assert totals(lied.ticks)[0] == 8 * 300 * S

    honest = apply_facts([*facts, finished(ran_s="300")], {}, book(), g, latest)
    assert honest.cut == 0 and not honest.states[("job-1", 1)].cut
    assert totals(honest.ticks) == totals(lied.ticks)
    # Without a latest end (as before), the same 300 s are billed the same.
    assert totals(apply_facts([*facts, finished(ran_s="300")], {}, book(), g).ticks) == totals(
        honest.ticks
    )
