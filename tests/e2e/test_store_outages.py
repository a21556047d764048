"""PostgreSQL, then Redis, then both go away for 8 s and come back (Redis empty), while jobs
arrive at 20/s (`bench/outages.py`). The services log and back off instead of failing or
spinning, raise a stall alert, recover by themselves, and lose nothing: every job ends exactly
once as its labels say, no run has two effects, no node holds more than it has, and no service
process dies."""

from __future__ import annotations

from bench.outages import outage_run


def test_store_outages_under_load_lose_nothing() -> None:
    figures = outage_run(rate=20.0, down_s=8.0, gap_s=8.0, seed=11, drain_s=300.0)
    samples = figures.pop("samples", {})
    line = f"{ {k: v for k, v in figures.items() if k != 'duplicates_by_topic'} } {samples}"
    assert figures["died"] == [], line
    assert figures["lost"] == 0, line
    assert figures["terminal_once"] == figures["jobs"], line
    assert figures["duplicate_effects"] == 0, line
    assert figures["double_allocations"] == 0, line
    assert figures["wrong_outcome"] == 0, line
    assert set(figures["recovery_s"]) == {"postgres", "redis", "both"}, line
    # They said so, and backed off: retries were logged (not silent), and an outage that
    # outlasted the alert threshold raised consumer_stalled.
    assert sum(figures["retries_logged"].values()) > 0, line
    assert figures["stall_alerts"] >= 1, line
