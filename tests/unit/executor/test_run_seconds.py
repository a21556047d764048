"""What an end event reports as a run's seconds can always be sent: a clock stepped back gives
0, not a negative time, and a run past the wire's bound (a served model running for months at
a dev time scale) reports the bound, not a value every reader refuses."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from schemas.bounds import MAX_RUN_S
from schemas.events import JobFinished
from services.executor.runs import run_seconds

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def test_run_seconds_are_what_the_wire_takes() -> None:
    assert run_seconds(T0, T0 + timedelta(seconds=1.5), 600) == 900.0
    assert run_seconds(T0, T0 - timedelta(seconds=3), 600) == 0.0  # the clock stepped back
    months = run_seconds(T0, T0 + timedelta(days=90), 600)
    assert months == MAX_RUN_S
    assert JobFinished(job_id="j", outcome="succeeded", ran_s=months).ran_s == MAX_RUN_S
