"""The meter's counters count a step once it has committed: a transaction that rolls back is
retried, and the ticks it would have counted are counted by the retry alone."""

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
from tests.unit.meter.builders import T0, book, grid, run


class FlakyRelay:
    """An outbox relay whose first `failures` commits fail (after the step ran)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.emitted: list[Any] = []

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        yield SimpleNamespace(conn=None, emit=self.emitted.extend)
        if self.failures:
            self.failures -= 1
            raise ConnectionError("connection lost while committing")


async def _nothing(*_args: Any) -> None:
    return None


async def _all_new(_conn: Any, ticks: list[Any]) -> list[Any]:
    return list(ticks)


def meter(relay: FlakyRelay, registry: CollectorRegistry) -> Meter:
    m = Meter(
        None,
        relay,  # type: ignore[arg-type]
        grid(),
        MeterConfig(),
        book(),
        MeterMetrics(registry),
        lag_s=0,
        idle_lag_s=0,
        max_ticks_per_pass=1000,
        max_idle_backfill=1,
    )
    state = RunState("job-1", 1, phase=Phase.OPEN, run=run())
    m.open = {state.key: state}
    m.idle_done = 10**12  # no idle accounting in this pass
    return m


def counted(registry: CollectorRegistry) -> tuple[float | None, ...]:
    return (
        registry.get_sample_value("qm_meter_spend_total", {"tenant": "vision", "currency": "USD"}),
        registry.get_sample_value("qm_meter_usage_accelerator_seconds_total", {"tenant": "vision"}),
        registry.get_sample_value("qm_meter_ticks_written_total", {"kind": "interval"}),
    )


async def test_a_clock_pass_rolled_back_and_retried_counts_its_ticks_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store, "insert_ticks", _all_new)
    for name in ("add_interval_usage", "save_billed", "add_budget_usage"):
        monkeypatch.setattr(store, name, _nothing)
    now = T0 + timedelta(minutes=5)

    once = CollectorRegistry()
    await meter(FlakyRelay(failures=0), once).tick(now)
    expected = counted(once)
    assert all(v is not None and v > 0 for v in expected)

    retried = CollectorRegistry()
    flaky = meter(FlakyRelay(failures=1), retried)
    with pytest.raises(ConnectionError):
        await flaky.tick(now)
    assert counted(retried) == (None, None, None)  # nothing committed, nothing counted
    await flaky.tick(now)
    assert counted(retried) == expected
