"""A gang's start-up time is observed once the change announcing its start has committed: a
change rolled back (and tried again) neither observes it twice nor loses it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from schemas.envelope import utcnow
from services.executor.backend import ReportKind, RunReport
from services.executor.handlers import Executor
from services.executor.metrics import ExecutorMetrics
from services.executor.nodes import NodeBook
from services.executor.simulated import RunEnd
from services.executor.store import RunningJob

LABELS = {"tenant": "vision", "queue": "default", "priority_class": "normal"}


class FlakyRelay:
    def __init__(self, failures: int) -> None:
        self.failures = failures

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        yield SimpleNamespace(conn=None, emit=lambda _out: None)
        if self.failures:
            self.failures -= 1
            raise ConnectionError("connection lost while committing")


class Store:
    """The store as it was before the failed change: the gang launched, not announced."""

    def __init__(self, job: RunningJob) -> None:
        self.job = job

    async def write(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    async def load(self) -> tuple[list[RunningJob], int, dict[str, float]]:
        return [RunningJob(**{**vars(self.job), "started": False})], 0, {}


class Backend:
    async def act(self, _acts: Any) -> None:
        return None


async def test_a_start_announced_by_a_change_rolled_back_is_observed_once() -> None:
    now = utcnow()
    job = RunningJob(
        "job-1", 1, 1, "vision", [], now, now + timedelta(hours=1), RunEnd.SUCCEEDED, started=False
    )
    registry = CollectorRegistry()
    executor = Executor(
        "c",
        NodeBook({}),
        Store(job),  # type: ignore[arg-type]
        FlakyRelay(failures=1),  # type: ignore[arg-type]
        ExecutorMetrics(registry),
        time_scale=1,
        default_duration_s=60,
        backend=Backend(),  # type: ignore[arg-type]
    )
    await executor.restore()
    executor.launching[job.key] = (now.timestamp() - 5, tuple(LABELS.values()))  # type: ignore[assignment]

    def observed() -> float | None:
        return registry.get_sample_value("qm_executor_startup_seconds_count", LABELS)

    running = [RunReport("job-1", 1, ReportKind.RUNNING)]
    with pytest.raises(ConnectionError):
        await executor.report(running)
    assert observed() in (None, 0)
    assert not executor.running["job-1"].started  # memory read back from the store
    await executor.report(running)  # the backend reports it running again
    assert observed() == 1
    assert job.key not in executor.launching
