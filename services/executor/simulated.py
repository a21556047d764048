"""How a job behaves on the simulated fleet: its run time and outcome come from its labels."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.job import JobSpec

DURATION_LABEL = "sim_duration_s"
OUTCOME_LABEL = "sim_outcome"


@dataclass(frozen=True)
class SimulatedRun:
    virtual_s: float  # how long it runs in virtual seconds
    outcome: str  # succeeded | failed
    reason_code: str | None
    message: str


def simulate(spec: JobSpec, default_duration_s: float) -> SimulatedRun:
    try:
        duration = float(spec.labels.get(DURATION_LABEL, default_duration_s))
    except ValueError:
        duration = default_duration_s
    duration = max(duration, 0.0)
    if spec.max_runtime_s is not None and duration > spec.max_runtime_s:
        return SimulatedRun(
            spec.max_runtime_s,
            "failed",
            "max_runtime_exceeded",
            f"stopped after its max runtime of {spec.max_runtime_s:g} s",
        )
    if spec.labels.get(OUTCOME_LABEL) == "failed":
        return SimulatedRun(
            duration,
            "failed",
            "application_error",
            "the job's process exited with code 1 (simulated)",
        )
    return SimulatedRun(duration, "succeeded", None, f"completed after {duration:g} s")
