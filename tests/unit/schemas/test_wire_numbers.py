"""Numbers on the wire that a consumer sizes work or state by are bounded where they are
parsed: each field takes its bound and refuses the value past it (and a negative one), so a
hostile or broken producer costs one dead letter, not the scheduler's cycles, the meter's
memory, a leader's lease or a month of reports (schemas/bounds.py says why each bound)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from schemas.bounds import MAX_AMOUNT, MAX_EPOCH, MAX_NODE_DEVICES, MAX_PRICE, MAX_RUN_S
from schemas.events import (
    CapacityDemand,
    ClusterCapacity,
    JobFinished,
    JobPreempted,
    LeaderFence,
    NodeHeartbeat,
    NodeInfo,
    PlacementRefused,
    PreemptionRequested,
    RunFailed,
)
from schemas.usage import BudgetExceeded, UsageTick

NOW = datetime(2026, 11, 28, tzinfo=UTC)
NODE = {
    "node_id": "n", "block": "b", "rack": "r", "nvlink_domain": "d", "accelerator_type": "H100",
    "generation": "hopper", "accelerator_memory_gb": 80, "relative_speed": 1, "accelerators": 8,
    "cpu": 64, "memory_gb": 512, "price_tier": "spot",
}  # fmt: skip
END = {"job_id": "j", "attempt": 1, "cluster": "c", "reason_code": "x", "message": "m"}
TICK = {
    "tick_id": "t", "kind": "close", "run_id": "j#1", "tenant": "a", "project": "p", "user": "u",
    "cluster": "c", "accelerator_type": "H100", "price_tier": "spot", "count": 1,
    "interval_s": 60, "interval_index": 1, "interval_start": NOW, "interval_end": NOW,
    "start_offset_s": 0, "end_offset_s": 1, "seconds": 1, "accelerator_seconds": 1,
    "unit_price": 1, "cost": 1,
}  # fmt: skip
BUDGET = {
    "budget_id": "b", "tenant": "a", "month": "2026-11", "unit": "currency", "limit": 10,
    "used": 9, "threshold_pct": 90, "enforcement": "deprioritize", "weight_factor": 0.5,
    "crossed_at": NOW, "message": "m",
}  # fmt: skip
PREEMPTION = {
    "job_id": "v", "attempt": 1, "cluster": "c", "tenant": "a", "priority_class": "low",
    "claim": {"rank": 0, "guaranteed": False}, "for_job": "j", "for_tenant": "b",
    "for_priority_class": "high", "for_claim": {"rank": 1, "guaranteed": True},
    "reason_code": "x", "message": "m", "grace_s": 1, "epoch": 1, "leader": "s",
}  # fmt: skip


def inventory(**node: Any) -> dict[str, Any]:
    return {
        "cluster": "c",
        "location": "l",
        "kind": "cloud",
        "prices": {},
        "nodes": [{**NODE, **node}],
    }


# (model, a valid payload, how to set the field, the largest value it takes, values refused)
CASES: list[tuple[type[BaseModel], dict[str, Any], str, Any, list[Any]]] = [
    (NodeInfo, NODE, "accelerators", MAX_NODE_DEVICES, [MAX_NODE_DEVICES + 1, 10**13, -1]),
    (
        NodeHeartbeat,
        {"node_id": "n", "cluster": "c", "accelerators": 8, "allocated_accelerators": 0},
        "accelerators",
        MAX_NODE_DEVICES,
        [MAX_NODE_DEVICES + 1, -8],
    ),
    (PlacementRefused, END, "epoch", MAX_EPOCH, [MAX_EPOCH + 1, 2**63, -1]),
    (LeaderFence, {"epoch": 1, "leader": "s"}, "epoch", MAX_EPOCH, [MAX_EPOCH + 1, -1]),
    (PreemptionRequested, PREEMPTION, "epoch", MAX_EPOCH, [10**17]),
    (
        CapacityDemand,
        {"scheduler": "s", "epoch": 1, "pending_jobs": 0},
        "epoch",
        MAX_EPOCH,
        [MAX_EPOCH + 1],
    ),
    (JobFinished, {"job_id": "j", "outcome": "succeeded"}, "ran_s", MAX_RUN_S, [1.7e9, -1]),
    (JobPreempted, END, "ran_s", MAX_RUN_S, [1e300, -0.5]),
    (JobPreempted, END, "work_lost_s", MAX_RUN_S, [1e308, -1]),
    (RunFailed, END, "ran_s", MAX_RUN_S, [MAX_RUN_S * 2]),
    (UsageTick, TICK, "cost", MAX_AMOUNT, [1e22, -1e22]),
    (UsageTick, TICK, "accelerator_seconds", -MAX_AMOUNT, [MAX_AMOUNT * 2]),
    (BudgetExceeded, BUDGET, "weight_factor", 1, [0, -1, 1.5]),
]


@pytest.mark.parametrize(("model", "base", "field", "edge", "refused"), CASES)
def test_each_bounded_number_takes_its_edge_and_refuses_past_it(
    model: type[BaseModel], base: dict[str, Any], field: str, edge: Any, refused: list[Any]
) -> None:
    assert getattr(model.model_validate({**base, field: edge}), field) == edge
    for value in refused:
        with pytest.raises(ValidationError) as error:
            model.model_validate({**base, field: value})
        assert field in str(error.value)


def test_an_inventory_is_refused_for_one_node_past_the_bound_or_one_price() -> None:
    assert ClusterCapacity.model_validate(inventory())
    with pytest.raises(ValidationError, match="accelerators"):
        ClusterCapacity.model_validate(inventory(accelerators=10**13))
    priced = {**inventory(), "prices": {"H100": {"spot": MAX_PRICE * 10}}}
    with pytest.raises(ValidationError, match="prices"):
        ClusterCapacity.model_validate(priced)
