"""The seam between the executor's decisions (handlers.py: refuse over-commit, epochs and
fences, tombstones, restart) and what carries them out. A backend turns an accepted placement
into a run record, and carries out the actions the executor decided once they are committed;
a backend whose runs end outside the process (Kubernetes) reports back with `RunReport`s,
which the executor judges like any other input (`Executor.report`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from schemas.events import PlacementDecided
from schemas.serving import SERVICE_LABEL
from services.executor.simulated import RunEnd, ready_after_s, simulate
from services.executor.store import RunKey, RunningJob


@dataclass(frozen=True)
class Launch:
    """Create what runs this accepted placement."""

    placement: PlacementDecided


@dataclass(frozen=True)
class Teardown:
    """Stop a run: its workload gets `grace_s` to end (None: the grace the job was granted)."""

    key: RunKey
    reason: str
    grace_s: int | None = None


@dataclass(frozen=True)
class SignalCheckpoint:
    """Tell the run's workload to save its work before `stop_at`."""

    key: RunKey
    at: datetime
    stop_at: datetime


@dataclass(frozen=True)
class Quarantine:
    """The health service took this node out: keep the cluster's own scheduler off it too."""

    node_id: str
    cause: str


@dataclass(frozen=True)
class Release:
    """The health service let this node back in: undo the quarantine."""

    node_id: str


Action = Launch | Teardown | SignalCheckpoint | Quarantine | Release


class ReportKind(StrEnum):
    RUNNING = "running"  # every replica runs: job.started
    SUCCEEDED = "succeeded"  # every replica succeeded: job.finished
    FAILED = "failed"  # a replica failed: job.run.failed, the gang is torn down
    REFUSED = "refused"  # it cannot start (unschedulable, invalid): placement.refused
    LOST = "lost"  # its workload vanished without an end: handed back (job.preempted)


@dataclass(frozen=True)
class RunReport:
    """What a backend saw one run do."""

    job_id: str
    attempt: int
    kind: ReportKind
    reason_code: str | None = None
    message: str = ""
    exit_code: int | None = None
    nodes: tuple[str, ...] = ()

    @property
    def key(self) -> RunKey:
        return (self.job_id, self.attempt)


class Backend(Protocol):
    def begin(self, p: PlacementDecided, now: datetime) -> RunningJob:
        """The run record of an accepted placement. `started` says whether it runs already
        (job.started now) or will be reported running later."""
        ...

    async def act(self, actions: Sequence[Action]) -> None:
        """Carry out what a committed change decided, in order. Must not raise for a failure of
        the cluster: the backend retries, or reports the run back."""
        ...


class SimulatedBackend:
    """Runs on the simulated fleet: a run's behaviour comes from its labels (simulated.py) and
    it ends on its clock (Executor.finish_due). Nothing to do outside the process."""

    def __init__(self, time_scale: float, default_duration_s: float) -> None:
        self.time_scale = time_scale
        self.default_duration_s = default_duration_s

    def begin(self, p: PlacementDecided, now: datetime) -> RunningJob:
        run = simulate(p.spec, self.default_duration_s, p.attempt, p.replicas)
        lasts = (
            NEVER
            if math.isinf(run.virtual_s)
            else timedelta(seconds=run.virtual_s / self.time_scale)
        )
        ready = ready_after_s(p.spec)
        return replace(
            open_run(p, now),
            started=True,
            ends_at=now + lasts,
            service=p.spec.labels.get(SERVICE_LABEL) if ready is not None else None,
            ready_at=None if ready is None else now + timedelta(seconds=ready / self.time_scale),
            end=run.end,
            reason_code=run.reason_code,
            message=run.message,
            exit_code=run.exit_code,
            step_s=run.step_s,
            checkpoint_s=run.checkpoint_s,
            checkpoint_every_s=run.checkpoint_every_s,
        )

    async def act(self, actions: Sequence[Action]) -> None:
        return None


# A run that ends only when its backend says so: never due on the executor's clock.
NEVER = timedelta(days=365 * 100)


def open_run(p: PlacementDecided, now: datetime) -> RunningJob:
    """The run record of a placement whose end a backend will report (not started yet)."""
    return RunningJob(
        job_id=p.job_id,
        attempt=p.attempt,
        epoch=p.epoch,
        tenant=p.spec.tenant,
        replicas=p.replicas,
        started_at=now,
        ends_at=now + NEVER,
        end=RunEnd.SUCCEEDED,
        started=False,
    )
