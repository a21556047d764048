"""The meter's clock pass looks at every open run only when an interval has closed since the
last pass; in between, at the runs a batch opened or changed. Whatever it skips, the ticks are
those of a pass over every run."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.meter import store
from services.meter.budgets import MeterConfig
from services.meter.handlers import Meter, MeterMetrics
from services.meter.runs import Phase, RunState
from tests.unit.meter.builders import T0, book, grid, placed, run, started


class Relay:
    def __init__(self) -> None:
        self.emitted: list[Any] = []

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async def claim(ids: list[str]) -> set[str]:
            return set(ids)

        yield SimpleNamespace(conn=None, emit=self.emitted.extend, claim=claim)


class _Untouchable:
    """An open run's state that fails when looked at."""

    key = ("untouchable", 1)

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the pass looked at a run billed already ({name})")


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The meter's store as a sink: every tick written is kept here."""
    written: list[Any] = []

    async def insert_ticks(_conn: Any, ticks: list[Any]) -> list[Any]:
        written.extend(ticks)
        return list(ticks)

    async def nothing(*_args: Any) -> None:
        return None

    async def no_runs(*_args: Any) -> dict[Any, Any]:
        return {}

    monkeypatch.setattr(store, "insert_ticks", insert_ticks)
    monkeypatch.setattr(store, "lock_runs", no_runs)
    for name in ("add_interval_usage", "save_billed", "add_budget_usage", "save_runs"):
        monkeypatch.setattr(store, name, nothing)
    monkeypatch.setattr(store, "save_pools", nothing)
    return written


def meter() -> Meter:
    m = Meter(
        None,
        Relay(),  # type: ignore[arg-type]
        grid(),
        MeterConfig(),
        book(),
        MeterMetrics(CollectorRegistry()),
        lag_s=0,
        idle_lag_s=0,
        max_ticks_per_pass=1000,
        max_idle_backfill=1,
    )
    m.idle_done = 10**12  # no idle accounting in these passes
    return m


def billed(written: list[Any], job_id: str) -> list[int]:
    """The intervals a job's ticks fall in, counted from T0's."""
    g = grid()
    first = g.index(g.virtual(T0))
    return sorted(t.interval_index - first for t in written if t.job_id == job_id)


async def test_a_run_opened_between_passes_is_billed_in_the_same_interval(
    stubbed: list[Any],
) -> None:
    m = meter()
    first = RunState("job-1", 1, phase=Phase.OPEN, run=run())
    m.open = {first.key: first}
    now = T0 + timedelta(minutes=5, seconds=10)
    await m.tick(now)
    assert billed(stubbed, "job-1") == [0, 1, 2, 3, 4]

    # Everything open is billed through interval 4: a pass within interval 5 need not look
    # at it again.
    m.open[_Untouchable.key] = _Untouchable()  # type: ignore[index]
    await m.tick(now + timedelta(seconds=5))

    # A batch opens a run that started a minute ago: the next pass, still before interval 5
    # ends, bills it through interval 4 like the rest.
    del m.open[_Untouchable.key]  # type: ignore[arg-type]
    facts = [
        ("p2", placed("job-2")),
        ("s2", started("job-2", at=T0 + timedelta(minutes=3, seconds=30))),
    ]
    await m._apply(facts, [])
    assert m.open[("job-2", 1)].phase is Phase.OPEN
    await m.tick(now + timedelta(seconds=10))
    assert billed(stubbed, "job-2") == [3, 4]

    # Interval 5 closes: every run is looked at, and both are billed through it.
    await m.tick(now + timedelta(minutes=1))
    assert billed(stubbed, "job-1") == [0, 1, 2, 3, 4, 5]
    assert billed(stubbed, "job-2") == [3, 4, 5]


async def test_a_new_interval_and_a_restart_look_at_every_run(stubbed: list[Any]) -> None:
    m = meter()
    state = RunState("job-1", 1, phase=Phase.OPEN, run=run())
    m.open = {state.key: state}
    await m.tick(T0 + timedelta(minutes=2, seconds=1))
    m.open[_Untouchable.key] = _Untouchable()  # type: ignore[index]
    with pytest.raises(AssertionError, match="billed already"):
        await m.tick(T0 + timedelta(minutes=3, seconds=1))  # interval 2 has closed
    m._billed_through = None  # as restore() leaves it
    with pytest.raises(AssertionError, match="billed already"):
        await m.tick(T0 + timedelta(minutes=3, seconds=2))
