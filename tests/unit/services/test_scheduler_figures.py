"""The leader's figures for /metrics: jobs by state, pending by reason, tenants' quota, use,
borrowing and shares, accelerators by state, free slots and fragmentation; and the cycle that
sets them (queue wait observed once per job, gauges refreshed at most once a second)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from faststream.kafka import KafkaBroker
from prometheus_client import CollectorRegistry

from core.model import JobId, NodeId
from core.policy import Policy
from core.reasons import PendingExplanation, ReasonCode
from core.state import CycleState
from services.scheduler import figures
from services.scheduler.cycle import FIGURES_EVERY_S, Cycle
from services.scheduler.handlers import SchedulerMetrics
from services.scheduler.state import SchedulerState
from tests.unit.core.builders import gpu_nodes, job, running, snapshot
from tests.unit.services.builders import POLICY_DOC, checked
from tests.unit.services.test_scheduler_preemption import (
    NOW,
    POLICY,
    SCALE,
    Published,
    placed,
    queued,
)
from tests.unit.services.test_scheduler_preemption import broker as broker
from tests.unit.services.test_scheduler_state import capacity


def quota_policy() -> Policy:
    return Policy.from_dict(
        {
            **POLICY_DOC,
            "tenants": {
                "vision": {"cohort": "lab", "quotas": {"H100": 8}, "borrow_limit": {"H100": 8}},
                "nlp": {"cohort": "lab", "quotas": {"H100": 8}, "weight": 3},
            },
        }
    )


def fleet() -> CycleState:
    """c1: two 8-GPU H100 nodes, 12 GPUs taken by vision on the first and part of the second;
    c2: one A100 node, quarantined."""
    nodes = {**gpu_nodes(2, type="H100"), **gpu_nodes(1, type="A100", cluster="c2")}
    sick = NodeId("c2-n-0000")
    nodes[sick] = replace(nodes[sick], healthy=False)
    big = running(job(8, tenant="vision", types=("H100",)), "c1-n-0000")
    small = running(job(4, tenant="vision", types=("H100",)), "c1-n-0001")
    waiting = job(1, tenant="nlp")
    return CycleState.from_snapshot(snapshot(nodes, [waiting], [big, small]), quota_policy())


def test_accelerators_by_state_free_slots_and_fragmentation() -> None:
    got = figures.fleet_figures(fleet().cap)
    assert got.accelerators[("c1", "H100", "allocated")] == 12
    assert got.accelerators[("c1", "H100", "idle")] == 4
    assert got.accelerators[("c1", "H100", "unhealthy")] == 0
    assert got.accelerators[("c2", "A100", "unhealthy")] == 8
    assert got.accelerators[("c2", "A100", "idle")] == 0
    assert [got.free_slots[("c1", "H100", str(s))] for s in figures.SLOT_SIZES] == [4, 2, 1, 0]
    assert got.free_slots[("c2", "A100", "1")] == 0  # quarantined devices start nothing
    # The 4 free devices are all on a half-used node: wholly fragmented for an 8-GPU gang.
    assert got.fragmentation[("c1", "H100")] == 1.0
    assert got.fragmentation[("c2", "A100")] == 0.0


def test_a_node_held_for_a_gang_counts_as_held_and_offers_no_slot() -> None:
    state = CycleState.from_snapshot(snapshot(gpu_nodes(2)), quota_policy())
    state.cap.held[0] = 0
    got = figures.fleet_figures(state.cap)
    assert got.accelerators[("c1", "H100", "held")] == 8
    assert got.accelerators[("c1", "H100", "idle")] == 8
    assert got.free_slots[("c1", "H100", "8")] == 1
    assert got.fragmentation[("c1", "H100")] == 0.0


def test_quota_use_borrowing_and_shares_per_tenant() -> None:
    got = figures.tenant_figures(fleet(), quota_policy())
    assert got.quota[("vision", "H100")] == 8
    assert got.quota[("nlp", "A100")] == 0  # a quota list without the type grants none
    assert got.allocated[("vision", "H100")] == 12
    assert got.borrowed == {("vision", "H100"): 4}
    # 12 of the 16 healthy H100s (the quarantined A100s are no capacity).
    assert got.dominant_share["vision"] == pytest.approx(12 / 16)
    assert got.dominant_share["nlp"] == 0
    # Both have work (vision runs, nlp waits): entitlements by weight, 1 and 3.
    assert got.fair_share == {"vision": pytest.approx(0.25), "nlp": pytest.approx(0.75)}
    assert got.ordering_share["vision"] == pytest.approx(12 / 16)


def test_jobs_by_state_and_pending_by_first_reason() -> None:
    state = SchedulerState()
    a, b, c = job(1, tenant="vision"), job(1, tenant="vision"), job(1, tenant="nlp")
    r1, r2 = running(job(8, tenant="nlp"), "c1-n-0000"), running(job(8), "c1-n-0001")
    for j in (a, b, c):
        state.pending[j.job_id] = j
    state.held[b.job_id] = 200.0  # backing off until then
    state.held[c.job_id] = 50.0  # its backoff is over
    for alloc in (r1, r2):
        state.running[alloc.job.job_id] = alloc
    state.preempting[r2.job.job_id] = (1, a.job_id)
    assert figures.jobs_by_state(state, now=100.0) == {
        ("pending", "vision"): 1,
        ("backing_off", "vision"): 1,
        ("pending", "nlp"): 1,
        ("running", "nlp"): 1,
        ("preempting", "vision"): 1,
    }
    codes = (ReasonCode.QUOTA_EXHAUSTED, ReasonCode.BEHIND_HIGHER_PRIORITY)
    explained = {
        a.job_id: PendingExplanation(codes, "quota"),
        b.job_id: PendingExplanation((ReasonCode.BACKING_OFF,), "later"),
        JobId("gone"): PendingExplanation((ReasonCode.INSUFFICIENT_CAPACITY,), "placed since"),
    }
    assert figures.pending_by_reason(state, explained) == {
        ("vision", "quota_exhausted"): 1,
        ("vision", "backing_off"): 1,
        ("nlp", figures.NO_REASON): 1,
    }


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_a_cycle_observes_queue_wait_once_and_refreshes_figures_at_most_each_second(
    broker: tuple[KafkaBroker, Published],
) -> None:
    kafka, _ = broker
    registry = CollectorRegistry()
    state = SchedulerState(time_scale=SCALE)
    state.on_capacity(capacity(2))
    state.on_queued(queued("first"))  # submitted at NOW - 100
    cycle = Cycle(
        state, POLICY, kafka, SchedulerMetrics(registry), "leader-1", SCALE, working=checked()
    )

    assert await cycle.run_once(epoch=1, now=NOW) == 1
    labels = {"tenant": "vision", "queue": "default", "priority_class": "low"}
    assert sample(registry, "qm_scheduler_queue_wait_seconds_count", **labels) == 1
    assert sample(registry, "qm_scheduler_queue_wait_seconds_sum", **labels) == pytest.approx(100)
    assert sample(registry, "qm_scheduler_jobs", state="running", tenant="vision") == 1
    assert sample(registry, "qm_fleet_accelerators", **fleet_labels("allocated")) == 8

    # Within the second: nothing is refreshed (the second job is not counted yet).
    state.on_queued(queued("second"))
    assert await cycle.run_once(epoch=1, now=NOW + FIGURES_EVERY_S / 2) == 1
    assert sample(registry, "qm_scheduler_jobs", state="running", tenant="vision") == 1
    assert sample(registry, "qm_scheduler_queue_wait_seconds_count", **labels) == 2

    state.on_queued(queued("third"))  # no room left: it waits
    await cycle.run_once(epoch=1, now=NOW + FIGURES_EVERY_S)
    assert sample(registry, "qm_scheduler_jobs", state="running", tenant="vision") == 2
    assert sample(registry, "qm_scheduler_jobs", state="pending", tenant="vision") == 1
    pending = sample(
        registry, "qm_scheduler_pending_by_reason", tenant="vision", reason="insufficient_capacity"
    )
    assert pending == 1
    assert sample(registry, "qm_fleet_accelerators", **fleet_labels("idle")) == 0
    assert sample(registry, "qm_scheduler_queue_wait_seconds_count", **labels) == 2

    cycle.metrics.forget_figures()  # deposed: a standby shows no leader's figures
    assert sample(registry, "qm_scheduler_jobs", state="running", tenant="vision") is None


def fleet_labels(state: str) -> dict[str, str]:
    return {"cluster": "c1", "accelerator_type": "H100", "state": state}


def test_the_first_placement_only_is_a_queue_wait() -> None:
    registry = CollectorRegistry()
    state = SchedulerState()
    state.on_queued(queued("again"))
    cycle = Cycle(state, POLICY, KafkaBroker(), SchedulerMetrics(registry), "leader-1")
    second = placed("again", "n0").model_copy(update={"attempt": 2})
    cycle._observe_wait(second, NOW)
    labels = {"tenant": "vision", "queue": "default", "priority_class": "low"}
    assert sample(registry, "qm_scheduler_queue_wait_seconds_count", **labels) is None
    cycle._observe_wait(placed("again", "n0"), NOW)
    assert sample(registry, "qm_scheduler_queue_wait_seconds_count", **labels) == 1
