"""The tick math: grid, cutting, pricing, and the invariant that a run's ticks add up exactly."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.usage import TickKind
from services.meter.ticks import (
    MICRO,
    Grid,
    Share,
    bill_through,
    close_run,
    micros,
    rdiv,
    spans,
)
from tests.unit.meter.builders import T0, after, grid, run

S = MICRO  # one second, one accelerator or one currency unit, in millionths


def total(ticks, field: str) -> int:  # type: ignore[no-untyped-def]
    return sum(getattr(t, field) for t in ticks)


def test_amounts_are_exact_millionths() -> None:
    assert micros(0.1) == 100_000 and micros("2.10") == 2_100_000 and micros(754.321) == 754_321_000
    assert rdiv(5, 10) == 1 and rdiv(-5, 10) == -1 and rdiv(4, 10) == 0


def test_the_grid_maps_wall_time_to_fleet_time_and_back() -> None:
    g = grid(60, time_scale=600)
    v = g.virtual(T0)
    assert v == int(T0.timestamp()) * 600 * S
    assert g.wall(v) == T0
    assert g.index(v) * 60 * S == v  # T0 x 600 is on an edge
    # One wall second is ten 60 s intervals at 600x.
    assert g.closed_through(after(1)) - g.closed_through(T0) == 10
    assert Grid.of("7.5", "1.5").interval_s == 7.5


def test_a_run_is_cut_at_the_grid_edges_with_partial_first_and_last_ticks() -> None:
    g = grid(60)
    r = run(count="8", price="2.10", start=after(15), g=g)
    ticks = close_run(r, 150 * S, g, "succeeded")
    assert [(t.kind, t.start_offset_u // S, t.end_offset_u // S) for t in ticks] == [
        (TickKind.INTERVAL, 0, 45),
        (TickKind.INTERVAL, 45, 105),
        (TickKind.CLOSE, 105, 150),
    ]
    assert [t.interval_start for t in ticks] == [after(15), after(60), after(120)]
    assert ticks[-1].interval_end == after(165)
    assert total(ticks, "accelerator_seconds_u") == 1200 * S  # 8 x 150
    assert total(ticks, "cost_u") == 700_000  # 1200 / 3600 x 2.10 = 0.70
    assert ticks[-1].outcome == "succeeded"
    assert len({t.tick_id for t in ticks}) == 3
    assert ticks[-1].tick_id == "job-1#1/close/reserved"


def test_billing_by_the_clock_then_closing_adds_up_to_the_run() -> None:
    g = grid(60)
    r = run(count="0.5", price="4.50", start=after(10), g=g)
    r, first = bill_through(r, g.index(g.virtual(after(10))), g)  # the interval it started in
    r, more = bill_through(r, g.index(g.virtual(after(200))), g)
    r, none = bill_through(r, g.index(g.virtual(after(200))), g)  # nothing new: idempotent
    assert none == []
    assert r.billed_u == 230 * S  # through the end of the interval holding t=200
    ticks = first + more + close_run(r, micros("301.5"), g, "failed")
    assert total(ticks, "seconds_u") == micros("301.5")
    assert total(ticks, "accelerator_seconds_u") == micros("150.75")
    assert total(ticks, "cost_u") == 188_438  # 150.75 / 3600 x 4.50 = 0.1884375, rounded once


def test_a_run_that_ended_inside_billed_time_gets_a_credit() -> None:
    g = grid(60)
    # Three whole intervals billed by the clock (180 s); then the end says it ran 130 s.
    r, billed = bill_through(run(start=T0, g=g), g.index(g.virtual(T0)) + 2, g)
    credit = close_run(r, 130 * S, g, "canceled")
    assert [(t.kind, t.seconds_u) for t in credit] == [(TickKind.CLOSE, -50 * S)]
    assert credit[0].interval_index == g.index(g.virtual(after(130)))
    assert total(billed + credit, "accelerator_seconds_u") == 8 * 130 * S


def test_a_run_ending_on_billed_edge_closes_with_a_zero_tick() -> None:
    g = grid(60)
    r, _ = bill_through(run(start=T0, g=g), g.index(g.virtual(T0)), g)
    close = close_run(r, 60 * S, g, "succeeded")
    assert [(t.kind, t.seconds_u) for t in close] == [(TickKind.CLOSE, 0)]


def test_a_split_allocation_has_one_tick_per_tier() -> None:
    g = grid(60)
    shares = (
        Share("on_demand", 8 * S, micros("4.50")),
        Share("reserved", 8 * S, micros("2.10")),
    )
    ticks = close_run(replace(run(start=T0, g=g), shares=shares), 90 * S, g, "succeeded")
    assert sorted((t.price_tier, t.kind.value) for t in ticks) == [
        ("on_demand", "close"),
        ("on_demand", "interval"),
        ("reserved", "close"),
        ("reserved", "interval"),
    ]
    assert total(ticks, "cost_u") == 1_320_000  # 8 x 90 s x (4.50 + 2.10) / 3600


def test_the_grid_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        Grid.of(0, 1)


@settings(max_examples=200, deadline=None)
@given(
    interval=st.sampled_from(["15", "60", "300", "7.5"]),
    scale=st.sampled_from(["1", "60", "1.5"]),
    start_ms=st.integers(0, 10**7),
    ran_ms=st.integers(0, 3 * 10**6),
    count=st.sampled_from(["0.25", "0.5", "1", "3", "8", "64"]),
    price=st.sampled_from(["0", "0.28", "1.10", "2.10", "4.50", "12.345"]),
    clock_ms=st.lists(st.integers(0, 6 * 10**6), max_size=5),
)
def test_whatever_the_clock_did_a_runs_ticks_add_up_exactly(
    interval: str,
    scale: str,
    start_ms: int,
    ran_ms: int,
    count: str,
    price: str,
    clock_ms: list[int],
) -> None:
    g = grid(float(interval), float(scale))
    r = run(count=count, price=price, start=after(start_ms / 1000), g=g)
    ticks = []
    for ms in sorted(clock_ms):  # the clock bills while the run is (believed) open
        r, new = bill_through(r, g.closed_through(after(ms / 1000)), g)
        ticks += new
    ran = ran_ms * 1000
    ticks += close_run(r, ran, g, "succeeded")
    true_acc = Fraction(micros(count) * ran, MICRO)  # millionths of accelerator-seconds
    true_cost = Fraction(micros(count) * micros(price) * ran, 3600 * MICRO * MICRO)
    assert total(ticks, "seconds_u") == ran
    assert total(ticks, "accelerator_seconds_u") == true_acc  # exact: no fraction to round
    assert abs(total(ticks, "cost_u") - true_cost) <= Fraction(1, 2)  # rounded once
    assert len({t.tick_id for t in ticks}) == len(ticks)
    assert sum(t.kind is TickKind.CLOSE for t in ticks) == 1
    for t in ticks:
        if t.kind is TickKind.INTERVAL:  # never straddles an edge
            assert 0 < t.seconds_u <= g.interval_u
            assert g.index(r.start_v + t.start_offset_u) == t.interval_index


@given(a=st.integers(0, 10**12), length=st.integers(0, 10**9))
def test_spans_tile_the_range(a: int, length: int) -> None:
    g = grid(60)
    parts = spans(1_234_500_000, a, a + length, g)
    assert sum(y - x for _, x, y in parts) == length
    assert all(parts[i][2] == parts[i + 1][1] for i in range(len(parts) - 1))
    assert all(0 < y - x <= 60 * S for _, x, y in parts)
