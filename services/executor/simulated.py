"""How a job behaves on the simulated fleet, decided from its labels: how long it runs, how it
ends, how fast its steps go and how it checkpoints. Pure: times are fleet seconds from the
start of the run; the executor turns them into wall-clock moments."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from schemas.events import ReplicaAssignment
from schemas.job import JobSpec, WorkloadKind
from schemas.serving import SERVICE_LABEL

DURATION_LABEL = "sim_duration_s"
OUTCOME_LABEL = "sim_outcome"
FAIL_ATTEMPTS_LABEL = "sim_fail_attempts"
MEMORY_LABEL = "sim_memory_gb"
STEP_LABEL = "sim_step_s"
CHECKPOINT_LABEL = "sim_checkpoint_s"
CHECKPOINT_EVERY_LABEL = "sim_checkpoint_every_s"
READY_LABEL = "sim_ready_after_s"

DEFAULT_STEP_S = 1.0
DEFAULT_CHECKPOINT_S = 10.0
DEFAULT_READY_S = 30.0  # a service replica loads its model this long before it serves
OOM_AT = 0.1  # an under-sized replica is killed this far into its run
STEP_NOISE = 0.02  # step times wander this much (relative) around their mean


class RunEnd(StrEnum):
    """How a run ends by itself. `run_failed` is the job's own fault and not terminal
    (job.run.failed); `failed` is terminal (job.finished), e.g. its max runtime ran out."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RUN_FAILED = "run_failed"


@dataclass(frozen=True)
class SimulatedRun:
    virtual_s: float  # how long it runs, in fleet seconds, until it ends by itself
    end: RunEnd
    reason_code: str | None
    message: str
    exit_code: int | None = None
    step_s: float = DEFAULT_STEP_S
    checkpoint_s: float = DEFAULT_CHECKPOINT_S
    checkpoint_every_s: float | None = None


def _number(labels: Mapping[str, str], name: str, default: float | None) -> float | None:
    """A non-negative number from a label; a missing or unreadable label gives the default."""
    raw = labels.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        return default
    return value if math.isfinite(value) and value >= 0 else default


def _memory_short(
    spec: JobSpec, replicas: Sequence[ReplicaAssignment], need_gb: float
) -> tuple[int, float] | None:
    """The first replica placed with less host memory than it really needs, and its limit."""
    limits = [(r.replica, r.memory_gb) for r in replicas] or [(0, spec.resources.memory_gb)]
    return next(((i, gb) for i, gb in sorted(limits) if gb < need_gb), None)


def _failure(
    spec: JobSpec, attempt: int, replicas: Sequence[ReplicaAssignment], duration: float
) -> SimulatedRun | None:
    """How the job itself fails on this attempt (out of memory, process error), if it does."""
    labels = spec.labels
    need_gb = _number(labels, MEMORY_LABEL, None)
    short = _memory_short(spec, replicas, need_gb) if need_gb is not None else None
    if short is not None:
        replica, limit = short
        return SimulatedRun(
            duration * OOM_AT,
            RunEnd.RUN_FAILED,
            "out_of_memory",
            f"replica {replica} was killed out of memory: it needs {need_gb:g} GB of host "
            f"memory and its limit is {limit:g} GB (simulated)",
            exit_code=137,
        )
    fail_attempts = _number(labels, FAIL_ATTEMPTS_LABEL, 0.0) or 0.0
    if labels.get(OUTCOME_LABEL) == "failed" or attempt <= fail_attempts:
        return SimulatedRun(
            duration,
            RunEnd.RUN_FAILED,
            "application_error",
            "the job's process exited with code 1 (simulated)",
            exit_code=1,
        )
    return None


def simulate(
    spec: JobSpec,
    default_duration_s: float,
    attempt: int = 1,
    replicas: Sequence[ReplicaAssignment] = (),
) -> SimulatedRun:
    """What this attempt of the job will do on these replicas."""
    labels = spec.labels
    duration = _number(labels, DURATION_LABEL, None)
    if duration is None and spec.kind is WorkloadKind.INFERENCE_SERVICE:
        duration = math.inf  # a service runs until it is stopped
    duration = max(default_duration_s if duration is None else duration, 0.0)
    run = _failure(spec, attempt, replicas, duration) or SimulatedRun(
        duration, RunEnd.SUCCEEDED, None, f"completed after {duration:g} s"
    )
    if spec.max_runtime_s is not None and run.virtual_s > spec.max_runtime_s:
        run = SimulatedRun(
            spec.max_runtime_s,
            RunEnd.FAILED,
            "max_runtime_exceeded",
            f"stopped after its max runtime of {spec.max_runtime_s:g} s",
        )
    every = _number(labels, CHECKPOINT_EVERY_LABEL, None)
    return SimulatedRun(
        run.virtual_s,
        run.end,
        run.reason_code,
        run.message,
        run.exit_code,
        step_s=_number(labels, STEP_LABEL, DEFAULT_STEP_S) or DEFAULT_STEP_S,
        checkpoint_s=_number(labels, CHECKPOINT_LABEL, DEFAULT_CHECKPOINT_S) or 0.0,
        checkpoint_every_s=every or None,  # 0 means never, like no label
    )


def ready_after_s(spec: JobSpec) -> float | None:
    """Fleet seconds from its start until a service replica serves; None for other work."""
    if spec.kind is not WorkloadKind.INFERENCE_SERVICE or not spec.labels.get(SERVICE_LABEL):
        return None
    return _number(spec.labels, READY_LABEL, DEFAULT_READY_S)


def kept_work_s(
    ran_s: float,
    *,
    checkpoint_s: float,
    every_s: float | None,
    requested: tuple[float, float] | None = None,
) -> float:
    """Fleet seconds of work a run of `ran_s` has saved. A checkpoint saves the state of the
    moment it starts and counts once it has completed, `checkpoint_s` later. Periodic ones
    start every `every_s` of run; `requested` is a signalled one as (started, completed)."""
    kept = 0.0
    if every_s:
        last = math.floor((ran_s - checkpoint_s) / every_s + 1e-9)
        kept = max(last, 0) * every_s
    if requested is not None and requested[1] <= ran_s:
        kept = max(kept, requested[0])
    return min(max(kept, 0.0), max(ran_s, 0.0))


def step_times(
    step_s: float,
    nodes: Sequence[str],
    slowdown: Mapping[str, float],
    rng: random.Random,
) -> list[float]:
    """Seconds per training step of replicas on these nodes: the job's base step, times the
    node's slowdown, with a little noise (a straggler stands out; healthy peers agree)."""
    return [
        round(step_s * slowdown.get(node, 1.0) * rng.uniform(1 - STEP_NOISE, 1 + STEP_NOISE), 6)
        for node in nodes
    ]
