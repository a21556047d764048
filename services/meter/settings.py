"""Meter settings (env prefix QM_)."""

from pathlib import Path

from pydantic import Field

from services.common.settings import REPO_ROOT, ServiceSettings


class MeterSettings(ServiceSettings):
    group_id: str = "meter"
    budgets_file: Path = REPO_ROOT / "examples" / "budgets.yaml"
    # Length of a metering interval in fleet seconds (QM_METER_INTERVAL_S).
    meter_interval_s: float = 60.0
    # An open run's interval is billed this long (wall clock) after it ends, so that a run
    # ending inside it is usually closed by its end event first rather than credited after.
    meter_lag_s: float = 1.0
    # Idle capacity of an interval is worked out later still, once its usage is in.
    meter_idle_lag_s: float = 5.0
    meter_tick_period_s: float = 0.25
    # After a restart, wait this long (at most) for the backlog of lifecycle events before
    # billing open runs by the clock.
    meter_startup_grace_s: float = 10.0
    # Catching up after downtime: at most about this many ticks per clock pass (transaction).
    meter_max_ticks_per_pass: int = 20_000
    meter_max_idle_backfill: int = 10_000
    # Lifecycle events are not on any job's critical path.
    fetch_max_wait_ms: int = 100
    # While records flow, each batch gathers what came in for this long (common/consumer.py).
    batch_linger_ms: int = Field(default=100, ge=0, le=10_000)
    max_batch_records: int = 2000
