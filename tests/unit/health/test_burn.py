"""Burn-rate evaluation: readings from scraped samples, tallies across process restarts, the
multiwindow verdicts, and breaches that open once per firing spell and close when it ends."""

from __future__ import annotations

import itertools
import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.health import Severity
from services.common.scrape import Sample, parse_metrics
from services.health.burn import (
    Breach,
    CannotCover,
    LevelVerdict,
    NoBucket,
    PairVerdict,
    Reading,
    Tally,
    burn_rate,
    clamp_count,
    decide,
    judge,
    max_points,
    points_for,
    reading_of,
)
from services.health.slofile import Sli, SliKind, SloFile, parse_slo_file

T0 = datetime(2025, 1, 1, tzinfo=UTC)
WAIT = Sli(SliKind.LATENCY, "qm_wait_seconds", (("priority_class", "high"),), threshold_s=60)
ERRORS = Sli(SliKind.ERRORS, "qm_http_request_duration_seconds", bad=(("status_class", "5xx"),))

EXPOSITION = """\
# TYPE qm_wait_seconds histogram
qm_wait_seconds_bucket{le="30.0",priority_class="high"} 5.0
qm_wait_seconds_bucket{le="60.0",priority_class="high"} 8.0
qm_wait_seconds_bucket{le="+Inf",priority_class="high"} 10.0
qm_wait_seconds_count{priority_class="high"} 10.0
qm_wait_seconds_sum{priority_class="high"} 400.0
qm_wait_seconds_bucket{le="30.0",priority_class="low"} 1.0
qm_wait_seconds_bucket{le="60.0",priority_class="low"} 1.0
qm_wait_seconds_bucket{le="+Inf",priority_class="low"} 50.0
qm_wait_seconds_count{priority_class="low"} 50.0
qm_wait_seconds_sum{priority_class="low"} 9000.0
# TYPE qm_http_request_duration_seconds histogram
qm_http_request_duration_seconds_count{method="GET",route="/a",status_class="2xx"} 90.0
qm_http_request_duration_seconds_count{method="GET",route="/a",status_class="5xx"} 7.0
qm_http_request_duration_seconds_count{method="POST",route="/b",status_class="4xx"} 3.0
"""


def slo_file(windows: list[dict[str, object]], objective: float = 0.9) -> SloFile:
    return parse_slo_file(
        {
            "alerts": {"page": {"severity": "critical", "windows": windows}},
            "slos": [
                {
                    "name": "wait",
                    "objective": objective,
                    "period": "1d",
                    "sli": {"kind": "latency", "metric": "qm_wait_seconds", "threshold_s": 60},
                }
            ],
        }
    )


PAGE = slo_file(
    [
        {"long": "60s", "short": "10s", "burn_rate": 5},
        {"long": "5m", "short": "30s", "burn_rate": 2},
    ]
)


def test_a_latency_reading_counts_the_threshold_bucket_of_the_filtered_series() -> None:
    assert reading_of(WAIT, parse_metrics(EXPOSITION)) == Reading(good=8.0, total=10.0)


def test_an_errors_reading_counts_the_bad_labels_out_of_every_event() -> None:
    assert reading_of(ERRORS, parse_metrics(EXPOSITION)) == Reading(good=93.0, total=100.0)


def test_a_target_without_the_series_reads_as_no_events() -> None:
    assert reading_of(WAIT, []) == Reading(0.0, 0.0)


def test_a_threshold_that_is_no_bucket_bound_is_refused() -> None:
    odd = Sli(SliKind.LATENCY, "qm_wait_seconds", threshold_s=45)
    with pytest.raises(NoBucket, match="no bucket at le=45"):
        reading_of(odd, parse_metrics(EXPOSITION))


def test_hostile_sample_values_are_left_out() -> None:
    samples = [
        Sample("qm_wait_seconds_count", {"priority_class": "high"}, math.nan),
        Sample("qm_wait_seconds_count", {"priority_class": "high"}, -4.0),
        Sample("qm_wait_seconds_count", {"priority_class": "high"}, 4.0),
        Sample("qm_wait_seconds_bucket", {"priority_class": "high", "le": "60.0"}, math.inf),
        Sample("qm_wait_seconds_bucket", {"priority_class": "high", "le": "sixty"}, 1.0),
        Sample("qm_wait_seconds_bucket", {"priority_class": "high", "le": "60.0"}, 3.0),
        # Finite but past 2**53, where a float64 no longer counts one by one: left out too
        # (1e20 would overflow the breach's bigint count; two of 1e308 sum to inf).
        Sample("qm_wait_seconds_count", {"priority_class": "high"}, 1e20),
        Sample("qm_wait_seconds_count", {"priority_class": "high"}, 1e308),
        Sample("qm_wait_seconds_bucket", {"priority_class": "high", "le": "60.0"}, 2.0**53 + 2),
    ]
    assert reading_of(WAIT, samples) == Reading(3.0, 4.0)
    at_limit = Sample("qm_wait_seconds_count", {"priority_class": "high"}, 2.0**53)
    assert reading_of(WAIT, [at_limit]).total == 2.0**53


def test_a_tally_that_overflows_starts_again_instead_of_going_nan() -> None:
    tally = Tally(keep_s=1000)
    tally.add(0, {"a": Reading(0, 0), "b": Reading(0, 0)})
    tally.add(10, {"a": Reading(5, 10), "b": Reading(5, 10)})
    huge = Reading(1e308, 1e308)
    tally.add(20, {"a": huge, "b": huge})  # 2e308 is inf, and inf - inf is NaN
    # A new history from here: nothing to judge on until it spans the windows again.
    assert [(p.at, p.good, p.total) for p in tally.points] == [(20, 0, 0)]
    assert tally.events(10) is None
    tally.add(30, {"a": Reading(math.inf, math.inf), "b": Reading(1e308, 1e308)})
    assert all(math.isfinite(p.good) and math.isfinite(p.total) for p in tally.points)
    tally.add(40, {"a": Reading(1, 2), "b": huge})
    tally.add(50, {"a": Reading(2, 4), "b": huge})
    events = tally.events(10)
    assert events is not None and all(math.isfinite(v) for v in events)
    assert events[1] == 2  # a's two events; b did not move


@pytest.mark.parametrize(
    ("bad", "count"),
    [(1e20, 2**63 - 1), (math.inf, 2**63 - 1), (math.nan, 0), (-3.0, 0), (41.6, 42)],
)
def test_a_breach_count_fits_the_stores_bigint(bad: float, count: int) -> None:
    [slo] = PAGE.slos
    [level] = slo.levels
    pairs = tuple(
        PairVerdict(p.long_s, p.short_s, p.burn_rate, 10.0, 10.0, bad, 100.0) for p in level.pairs
    )
    d = decide(PAGE, {"wait": (LevelVerdict(slo, level, pairs),)}, {}, T0, lambda: "a1")
    assert [b.count for b in d.opened] == [count]
    assert clamp_count(bad) == count


def test_a_tally_counts_increases_from_the_first_reading_and_survives_a_restart() -> None:
    tally = Tally(keep_s=1000)
    tally.add(0, {"a": Reading(100, 100), "b": Reading(5, 10)})  # the past: a baseline only
    tally.add(10, {"a": Reading(110, 120), "b": Reading(5, 10)})
    tally.add(20, {"a": Reading(2, 4), "b": Reading(6, 11)})  # a restarted: counts from zero
    tally.add(30, {"b": Reading(6, 12)})  # a did not answer: left out, not zero
    tally.add(40, {})  # nobody answered: no point at all
    assert [(p.at, p.good, p.total) for p in tally.points] == [
        (0, 0, 0),
        (10, 10, 20),
        (20, 13, 25),
        (30, 13, 26),
    ]
    assert tally.events(10) == (1, 1)  # bad, total over the last 10 s
    assert tally.events(20) == (3, 6)
    assert tally.events(10_000) == (13, 26)  # shorter history than the window: all of it


def test_a_tally_keeps_only_what_its_longest_window_needs() -> None:
    tally = Tally(keep_s=60, max_points=1000)
    for i in range(200):
        tally.add(i * 10, {"a": Reading(i, i)})
    assert tally.points[0].at == 1990 - 60 and len(tally.points) == 7
    capped = Tally(keep_s=10_000, max_points=5)
    for i in range(50):
        capped.add(i, {"a": Reading(i, i)})
    assert len(capped.points) == 5


@pytest.mark.parametrize(
    ("bad", "total", "objective", "rate"),
    [(0, 0, 0.99, 0.0), (1, 100, 0.99, 1.0), (5, 10, 0.9, 5.0), (10, 10, 0.95, 20.0)],
)
def test_the_burn_rate_is_the_error_ratio_over_the_budget(
    bad: float, total: float, objective: float, rate: float
) -> None:
    assert burn_rate(bad, total, objective) == pytest.approx(rate)


def run(tally: Tally, start: float, seconds: int, good_per_s: float, bad_per_s: float) -> float:
    """Feed one reading a second from `start`; returns the time after the last."""
    last = tally.last.get("t", Reading(0.0, 0.0))  # the process's own counters
    good, total = last.good, last.total
    at = start
    for _ in range(seconds):
        at += 1
        good += good_per_s
        total += good_per_s + bad_per_s
        tally.add(at, {"t": Reading(good, total)})
    return at


def test_judge_waits_for_each_long_window_then_fires_on_both_windows_only() -> None:
    [slo] = PAGE.slos
    tally = Tally(keep_s=slo.longest_s)
    at = run(tally, 0, 5, good_per_s=10, bad_per_s=0)
    assert judge(slo, tally) is None  # 5 s of history, the shortest long window is 60 s
    at = run(tally, at, 120, good_per_s=10, bad_per_s=0)
    [page] = judge(slo, tally) or ()
    # The 60 s pair is judged; the 5 m one is not yet (its long window is not covered).
    assert [p.long_s for p in page.pairs] == [60] and not page.complete
    at = run(tally, at, 180, good_per_s=10, bad_per_s=0)
    [page] = judge(slo, tally) or ()
    assert [p.long_s for p in page.pairs] == [60, 300] and page.complete
    assert page.firing is None
    # Half the events bad: burn 5 (budget 10%) -- at the threshold, not above it.
    at = run(tally, at, 15, good_per_s=5, bad_per_s=5)
    [page] = judge(slo, tally) or ()
    assert page.pairs[0].short_burn == pytest.approx(5.0) and page.firing is None
    # All bad: the short window burns 10x at once, the long one catches up later.
    at = run(tally, at, 3, good_per_s=0, bad_per_s=10)
    [page] = judge(slo, tally) or ()
    assert page.pairs[0].short_burn > 5 and page.pairs[0].long_burn < 5
    assert page.firing is None
    at = run(tally, at, 60, good_per_s=0, bad_per_s=10)
    [page] = judge(slo, tally) or ()
    fired = page.firing
    assert fired is not None and fired.long_s == 60 and fired.long_burn > 5
    # Good again: a pair stops firing as soon as its short window clears, though its long
    # window still burns; the level fires while any of its pairs does.
    at = run(tally, at, 11, good_per_s=10, bad_per_s=0)
    [page] = judge(slo, tally) or ()
    assert page.pairs[0].long_burn > 5 and not page.pairs[0].firing
    assert page.firing is page.pairs[1]
    run(tally, at, 20, good_per_s=10, bad_per_s=0)
    [page] = judge(slo, tally) or ()
    assert page.pairs[1].short_burn == 0 and page.firing is None


def verdicts_for(slos: SloFile, tally: Tally) -> dict[str, object]:
    return {s.name: judge(s, tally) for s in slos.slos}


def test_a_breach_opens_once_stays_open_closes_and_a_second_one_opens_afresh() -> None:
    [slo] = PAGE.slos
    ids = (f"alert-{i}" for i in itertools.count())
    tally = Tally(keep_s=slo.longest_s)
    open_: dict[tuple[str, str], Breach] = {}
    opened: list[Breach] = []
    closed: list[Breach] = []

    def step(seconds: int, good: float, bad: float) -> None:
        nonlocal at
        for _ in range(seconds):
            at = run(tally, at, 1, good, bad)
            d = decide(PAGE, verdicts_for(PAGE, tally), open_, T0 + timedelta(seconds=at),
                       lambda: next(ids))  # fmt: skip
            for b in d.closed:
                del open_[b.key]
            open_.update({b.key: b for b in d.opened})
            opened.extend(d.opened)
            closed.extend(d.closed)

    at = 0.0
    step(300, 10, 0)  # history covers every window
    step(60, 0, 10)  # a breach that lasts
    assert [b.breach_id for b in opened] == ["alert-0"] and closed == []
    breach = opened[0]
    assert (breach.subject, breach.cause, breach.severity) == ("slo/wait", "slo_burn_page",
                                                               Severity.CRITICAL)  # fmt: skip
    assert "SLO wait" in breach.suggested_action and "/ui/scheduler" in breach.suggested_action
    assert "x over 1m" in breach.suggested_action and breach.count > 0
    step(120, 10, 0)
    assert [b.breach_id for b in closed] == ["alert-0"] and closed[0].closed_at is not None
    step(60, 0, 10)
    assert [b.breach_id for b in opened] == ["alert-0", "alert-1"]


def test_an_slo_not_judged_keeps_its_breach_and_one_gone_from_the_file_is_closed() -> None:
    kept = Breach("a1", "wait", "page", Severity.CRITICAL, "x", T0, 3)
    gone = Breach("a2", "retired", "page", Severity.CRITICAL, "x", T0, 3)
    d = decide(PAGE, {"wait": None}, {kept.key: kept, gone.key: gone}, T0, lambda: "new")
    assert d.opened == () and [b.breach_id for b in d.closed] == ["a2"]


@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=50),  # events since the last reading
            st.integers(min_value=0, max_value=50),  # of which bad (capped below)
            st.booleans(),  # the process restarted before this reading
        ),
        max_size=60,
    )
)
def test_a_tally_never_decreases_and_never_counts_more_than_happened(
    steps: list[tuple[int, int, bool]],
) -> None:
    tally = Tally(keep_s=10**9)
    good = total = 0.0
    happened_good = happened_total = 0.0
    tally.add(0, {"t": Reading(0, 0)})
    for i, (events, bad, restarted) in enumerate(steps, start=1):
        bad = min(bad, events)
        if restarted:
            good = total = 0.0
        good += events - bad
        total += events
        happened_good += events - bad
        happened_total += events
        tally.add(i, {"t": Reading(good, total)})
    points = list(tally.points)
    for before, after in itertools.pairwise(points):
        assert after.good >= before.good and after.total >= before.total
    assert points[-1].total <= happened_total and points[-1].good <= happened_good
    assert points[-1].total - points[-1].good >= 0


@given(st.lists(st.booleans(), max_size=80))
def test_one_alert_per_firing_spell(firing: list[bool]) -> None:
    """Whatever the sequence of firing and quiet rounds, an alert goes out at the start of
    each firing spell and at no other time, and a breach is open exactly while it fires."""
    [slo] = PAGE.slos
    [level] = slo.levels
    ids = (f"a{i}" for i in itertools.count())
    open_: dict[tuple[str, str], Breach] = {}
    alerts = 0
    for fires in firing:
        burn = 10.0 if fires else 0.0
        pairs = tuple(
            PairVerdict(p.long_s, p.short_s, p.burn_rate, burn, burn, burn, 100.0)
            for p in level.pairs
        )
        d = decide(PAGE, {"wait": (LevelVerdict(slo, level, pairs),)}, open_, T0,
                   lambda: next(ids))  # fmt: skip
        for b in d.closed:
            del open_[b.key]
        open_.update({b.key: b for b in d.opened})
        alerts += len(d.opened)
        assert bool(open_) == fires
    assert alerts == sum(1 for a, b in itertools.pairwise([False, *firing]) if b and not a)


# The shipped alert levels: page 14.4x 1h/5m and 6x 6h/30m, ticket 1x 3d/6h.
SHIPPED_LEVELS = {
    "page": {
        "severity": "critical",
        "windows": [
            {"long": "1h", "short": "5m", "burn_rate": 14.4},
            {"long": "6h", "short": "30m", "burn_rate": 6},
        ],
    },
    "ticket": {"severity": "warning", "windows": [{"long": "3d", "short": "6h", "burn_rate": 1}]},
}
SHIPPED = parse_slo_file(
    {
        "alerts": SHIPPED_LEVELS,
        "slos": [
            {
                "name": "cycle",
                "objective": 0.99,
                "period": "28d",
                "sli": {"kind": "latency", "metric": "qm_wait_seconds", "threshold_s": 60},
            }
        ],
    }
)


def feed(tally: Tally, start: float, seconds: int, every_s: int, good: float, bad: float) -> float:
    """Rounds every `every_s` for `seconds`, with good and bad events per second."""
    last = tally.last.get("t", Reading(0.0, 0.0))
    g, t = last.good, last.total
    at = start
    for _ in range(seconds // every_s):
        at += every_s
        g += good * every_s
        t += (good + bad) * every_s
        tally.add(at, {"t": Reading(g, t)})
    return at


def test_after_a_start_a_level_is_not_judged_on_less_than_its_long_window() -> None:
    """2% slow cycles in the first minutes against 99% is a burn of 2: above the ticket's 1x,
    but over 5 minutes, not 3 days. Nothing fires until the pair's long window is covered."""
    [slo] = SHIPPED.slos
    tally = Tally(keep_s=slo.longest_s, max_points=points_for(slo.longest_s, 15))
    at = feed(tally, 0, 15, 15, 0, 0)  # the baseline round
    at = feed(tally, at, 600, 15, good=49, bad=1)
    assert judge(slo, tally) is None  # 10 minutes: not even the page's 1 h window
    d = decide(SHIPPED, {"cycle": judge(slo, tally)}, {}, T0, lambda: "a1")
    assert not d
    at = feed(tally, at, 3600, 15, good=49, bad=1)
    page, ticket = judge(slo, tally) or ()
    assert [p.long_s for p in page.pairs] == [3600] and not page.complete
    assert ticket.pairs == () and ticket.firing is None and not ticket.complete
    d = decide(SHIPPED, {"cycle": judge(slo, tally)}, {}, T0, lambda: "a1")
    assert not d  # the 2x burn over an hour is under the page's 14.4x; the ticket waits


def test_after_a_start_an_open_breach_is_not_closed_on_a_short_history() -> None:
    """A restart mid-incident: the open ticket (and page) breaches stay open through clean
    minutes and hours until every window of their level has been covered."""
    [slo] = SHIPPED.slos
    ticket = Breach("t1", "cycle", "ticket", Severity.WARNING, "x", T0, 3)
    page = Breach("p1", "cycle", "page", Severity.CRITICAL, "x", T0, 3)
    open_ = {ticket.key: ticket, page.key: page}
    tally = Tally(keep_s=slo.longest_s, max_points=points_for(slo.longest_s, 15))
    at = feed(tally, 0, 15, 15, 0, 0)
    at = feed(tally, at, 300, 15, good=50, bad=0)  # 5 clean minutes
    assert not decide(SHIPPED, {"cycle": judge(slo, tally)}, open_, T0, lambda: "n")
    at = feed(tally, at, 2 * 3600, 15, good=50, bad=0)  # 2 h: the 1 h pair is clean...
    assert not decide(SHIPPED, {"cycle": judge(slo, tally)}, open_, T0, lambda: "n")
    at = feed(tally, at, 5 * 3600, 15, good=50, bad=0)  # ...6 h: every page pair is
    d = decide(SHIPPED, {"cycle": judge(slo, tally)}, open_, T0, lambda: "n")
    assert [b.breach_id for b in d.closed] == ["p1"] and d.opened == ()
    feed(tally, at, 3 * 86400, 15, good=50, bad=0)
    d = decide(SHIPPED, {"cycle": judge(slo, tally)}, {ticket.key: ticket}, T0, lambda: "n")
    assert [b.breach_id for b in d.closed] == ["t1"]


def test_the_point_cap_follows_the_evaluation_interval() -> None:
    """At 5 s rounds the 3-day window needs 51,840 points: a fixed cap of 20,000 would have
    judged the ticket level on ~28 hours."""
    [slo] = SHIPPED.slos
    caps = max_points(SHIPPED, 5)
    assert caps["cycle"] >= 3 * 86400 // 5
    tally = Tally(keep_s=slo.longest_s, max_points=caps["cycle"])
    at = feed(tally, 0, 4 * 86400, 5, good=1, bad=0)
    assert tally.span_s >= 3 * 86400 and tally.points[-1].at == at
    assert [len(v.pairs) for v in judge(slo, tally) or ()] == [2, 1]
    assert max_points(SHIPPED, 15)["cycle"] < 20_000
    with pytest.raises(CannotCover, match=r"cycle's 3d window .* every 2.6 s or more"):
        max_points(SHIPPED, 1)
