"""Readable builders for the preemptor's decision tests: a policy with a preempting class,
limits at 60x time, requests, job facts and situations around a fixed clock."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from core.policy import Policy
from services.preemptor.guards import JobFacts, Limits, Request, Situation

T0 = datetime(2026, 1, 1, 12, tzinfo=UTC)
SCALE = 60.0  # fleet seconds per wall second

POLICY = Policy.from_dict(
    {
        "priority_classes": [
            {"name": "low", "rank": 0},
            {"name": "normal", "rank": 10},
            {"name": "high", "rank": 50, "preempting": True},
            {"name": "pushy", "rank": 60},  # outranks, but may not preempt
        ],
        "preemption": {
            "min_runtime_s": 600,
            "grace_cap_s": 120,
            "max_preemptions_per_tenant": 2,
            "budget_window_s": 3600,
        },
    }
)
LIMITS = Limits.of(POLICY, time_scale=SCALE, victim_wait_s=30)


def wall(fleet_s: float) -> timedelta:
    return timedelta(seconds=fleet_s / SCALE)


def request(**fields: Any) -> Request:
    base = Request(
        id="req-1",
        job_id="victim",
        attempt=1,
        cluster="c1",
        tenant="vision",
        priority_class="low",
        claim=(0, False, 0),
        for_job="asker",
        for_priority_class="high",
        for_claim=(50, True, 0),
        reason_code="preempted_for_priority",
        grace_s=60,
        epoch=5,
        requested_at=T0,
    )
    return replace(base, **fields)


def running(job_id: str = "victim", attempt: int = 1, ran_s: float = 3600) -> JobFacts:
    """A job whose run `attempt` started `ran_s` fleet seconds before T0."""
    return JobFacts(job_id, started_attempt=attempt, started_at=T0 - wall(ran_s))


def situation(**fields: Any) -> Situation:
    base = Situation(
        fence_epoch=5,
        active=False,
        victim=running(),
        requester=JobFacts("asker"),
        tenant_signals=(),
        received_at=T0,
    )
    return replace(base, **fields)


# --- wire messages, as the scheduler, executors and queue write them ---------------------


def wire_request(job_id: str = "victim", **fields: Any) -> dict[str, Any]:
    """A PreemptionRequested payload (JSON-ready)."""
    body: dict[str, Any] = {
        "job_id": job_id,
        "attempt": 1,
        "cluster": "c1",
        "tenant": "vision",
        "priority_class": "low",
        "claim": {"rank": 0, "guaranteed": False, "level": 0},
        "for_job": "asker",
        "for_tenant": "nlp",
        "for_priority_class": "high",
        "for_claim": {"rank": 50, "guaranteed": True, "level": 0},
        "reason_code": "preempted_for_priority",
        "message": "room for asker",
        "grace_s": 60,
        "epoch": 5,
        "leader": "scheduler-a",
    }
    body.update(fields)
    return body
