"""What one scheduling cycle decides: placements to publish, victims to preempt, reasons to show."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from core.model import Allocation, JobId
from core.reasons import PendingExplanation, ReasonCode


@dataclass(frozen=True)
class Victim:
    job_id: JobId
    reason: ReasonCode
    message: str


@dataclass(frozen=True)
class PreemptionDecision:
    """Preempt `victims` so that `for_job` can be placed in a later cycle once they have left."""

    for_job: JobId
    victims: tuple[Victim, ...]


@dataclass(frozen=True)
class CycleResult:
    placements: tuple[Allocation, ...]
    preemptions: tuple[PreemptionDecision, ...]
    pending: Mapping[JobId, PendingExplanation] = field(default_factory=dict)
