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
    monkeypatch.setattr(store, "save_announced", nothing)
    return written


async def _nothing(*_args: Any) -> None:
    return None


def meter() -> Meter:
    """A meter with one run open (job-1, started at T0)."""
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
    state = RunState("job-1", 1, phase=Phase.OPEN, run=run())  # started at T0
    m.open = {state.key: state}
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


async def test_a_new_interval_looks_at_every_run(stubbed: list[Any]) -> None:
    m = meter()
    await m.tick(T0 + timedelta(minutes=2, seconds=1))
    m.open[_Untouchable.key] = _Untouchable()  # type: ignore[index]
    with pytest.raises(AssertionError, match="billed already"):
        await m.tick(T0 + timedelta(minutes=3, seconds=1))  # interval 2 has closed


async def test_after_a_restart_the_first_pass_looks_at_every_run(
    stubbed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    m = meter()
    state = m.open[("job-1", 1)]
    now = T0 + timedelta(minutes=2, seconds=1)
    await m.tick(now)
    await m.tick(now + timedelta(seconds=1))  # nothing new: billed through interval 1
    assert m._billed_through is not None

    async def load_open(_pool: Any) -> list[Any]:
        return [state, _Untouchable()]

    async def load_pools(_pool: Any) -> list[Any]:
        return []

    async def idle_through(_pool: Any) -> int:
        return 10**12

    async def load_announced(_pool: Any) -> dict[str, Any]:
        return {}

    monkeypatch.setattr(store, "load_open", load_open)
    monkeypatch.setattr(store, "load_pools", load_pools)
    monkeypatch.setattr(store, "idle_through", idle_through)
    monkeypatch.setattr(store, "load_announced", load_announced)
    await m.restore()
    with pytest.raises(AssertionError, match="billed already"):
        await m.tick(now + timedelta(seconds=2))  # same interval, but nothing is known


async def test_a_pass_held_back_by_the_catch_up_limit_looks_at_every_run_again(
    stubbed: list[Any],
) -> None:
    """A run far behind is billed a few intervals a pass; until it has caught up, no pass
    may take the runs as billed through the last closed interval."""
    m = meter()  # job-1 is far behind: started at T0, never billed
    m.max_ticks_per_pass = 2  # two intervals a run in a pass
    now = T0 + timedelta(minutes=6, seconds=1)  # intervals 0-5 have closed
    held = [await m.tick(now + timedelta(seconds=i)) for i in range(3)]
    assert held == [True, True, False]
    assert billed(stubbed, "job-1") == [0, 1, 2, 3, 4, 5]
    assert m._billed_through is not None and not m._fresh


async def test_a_pass_that_fails_leaves_what_it_knew(
    stubbed: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    m = meter()
    await m.tick(T0 + timedelta(minutes=2, seconds=1))
    facts = [("p2", placed("job-2")), ("s2", started("job-2", at=T0 + timedelta(seconds=30)))]
    await m._apply(facts, [])
    known = (m._billed_through, dict(m._fresh))

    async def broken(*_args: Any) -> list[Any]:
        raise ConnectionError("connection lost")

    monkeypatch.setattr(store, "insert_ticks", broken)
    with pytest.raises(ConnectionError):
        await m.tick(T0 + timedelta(minutes=2, seconds=2))
    assert (m._billed_through, dict(m._fresh)) == known
    monkeypatch.undo()
    stubbed.clear()

    async def insert_ticks(_conn: Any, ticks: list[Any]) -> list[Any]:
        stubbed.extend(ticks)
        return list(ticks)

    monkeypatch.setattr(store, "insert_ticks", insert_ticks)
    for name in ("add_interval_usage", "save_billed", "add_budget_usage"):
        monkeypatch.setattr(store, name, _nothing)
    await m.tick(T0 + timedelta(minutes=2, seconds=3))
    assert billed(stubbed, "job-2") == [0, 1]  # billed by the pass that came after
