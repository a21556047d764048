"""The simulator's fast path (`decide(..., explain_pending=False)`) passes by jobs it knows can
only miss; it must make exactly the decisions of the explaining cycle the live scheduler runs."""

from __future__ import annotations

import random
from dataclasses import replace
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.cycle import CycleState, _Run, decide, schedule
from core.model import JobId, Node, NodeId, Snapshot
from core.policy import Backfill, BackfillMode, OrderingMode, Policy
from core.reasons import ReasonCode
from tests.unit.core.builders import gang, gpu_nodes, job, running, snapshot

QUOTAS = {
    "a": {"cohort": "c", "quotas": {"H100": 16, "A100": 8}, "borrow_limit": {"H100": 16}},
    "b": {"cohort": "c", "quotas": {"H100": 8}, "lend_limit": {"H100": 4}},
    "c": {"cohort": "c", "quotas": {"*": 0}},
}
BASE = Policy.from_dict({"preemption": {"min_runtime_s": 0}})
POLICIES = {
    "default": Policy.default(),
    "strict-fifo": replace(
        BASE,
        ordering=OrderingMode.FIFO,
        backfill=Backfill(BackfillMode.OFF),
        preemption=replace(BASE.preemption, enabled=False),
    ),
    "greedy-fifo": replace(
        BASE, ordering=OrderingMode.FIFO, backfill=Backfill(BackfillMode.GREEDY)
    ),
    "las": replace(BASE, ordering=OrderingMode.LAS, backfill=Backfill(BackfillMode.GREEDY)),
    "quotas": Policy.from_dict({"tenants": QUOTAS, "preemption": {"min_runtime_s": 0}}),
    "small-holds": replace(
        BASE,
        backfill=Backfill(BackfillMode.RESERVE, max_reservations=1, min_reserved_accelerators=4),
    ),
}


@st.composite
def fleets(draw: st.DrawFn) -> dict[NodeId, Node]:
    nodes: dict[NodeId, Node] = {}
    for c in range(draw(st.integers(1, 2))):
        for g, type_name in enumerate(
            draw(st.lists(st.sampled_from(["H100", "A100"]), max_size=2))
        ):
            nodes |= gpu_nodes(
                draw(st.integers(1, 5)),
                gpus=draw(st.sampled_from([2, 4, 8])),
                type=type_name,
                cluster=f"c{c}",
                prefix=f"g{g}",
                nodes_per_rack=draw(st.integers(1, 3)),
            )
    return nodes


@st.composite
def states(draw: st.DrawFn) -> Snapshot:
    nodes = draw(fleets())
    pending = []
    for i in range(draw(st.integers(0, 40))):
        gpus = draw(st.sampled_from([0, 0.5, 1, 1, 1, 2, 4, 8]))
        pending.append(
            job(
                gpus,
                job_id=f"j{i:03d}",
                replicas=1 if gpus < 1 else draw(st.sampled_from([1, 1, 1, 2, 3])),
                tenant=draw(st.sampled_from(["a", "b", "c"])),
                priority=draw(st.sampled_from(["low", "normal", "normal", "high"])),
                types=draw(st.sampled_from([(), (), ("H100",), ("A100",)])),
                submit=float(draw(st.integers(0, 9))),
                cpu=float(draw(st.sampled_from([0, 0, 4]))),
                memory_gb=0.0,
                max_runtime_s=draw(st.sampled_from([None, None, 60.0, 1e6])),
            )
        )
    first = schedule(snapshot(nodes, pending[::2]), POLICIES["quotas"], 0.0, random.Random(0))
    snap = snapshot(nodes, pending[1::2], first.placements)
    attained = {JobId(j.job_id): float(draw(st.integers(0, 400_000))) for j in pending}
    return replace(snap, attained=attained)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=50, deadline=None)
@given(snap=states())
def test_fast_path_decides_exactly_like_the_explaining_cycle(name: str, snap: Snapshot) -> None:
    pol = POLICIES[name]
    full = decide(CycleState.from_snapshot(snap, pol), pol, 100.0, explain_pending=True)
    fast = decide(CycleState.from_snapshot(snap, pol), pol, 100.0, explain_pending=False)
    assert fast.placements == full.placements
    assert fast.preemptions == full.preemptions
    assert fast.pending == {}
    # And both as they were before quota's verdicts were kept within a cycle.
    with patch.object(_Run, "_admit", _Run._admit_afresh):
        afresh = decide(CycleState.from_snapshot(snap, pol), pol, 100.0, explain_pending=True)
    assert afresh == full


def test_holds_last_one_cycle_on_a_long_lived_state() -> None:
    """A gang's hold must not outlive its cycle: the next cycle on the same state decides as a
    fresh snapshot would (a stale hold once kept later gangs from holding anything)."""
    pol = replace(
        BASE,
        backfill=Backfill(BackfillMode.RESERVE, max_reservations=1, min_reserved_accelerators=16),
    )
    nodes = gpu_nodes(4, nodes_per_rack=4)
    busy = [
        running(job(4, job_id="r0"), "c1-n-0000"),
        running(job(4, job_id="r2"), "c1-n-0002"),
    ]
    first = gang(3, job_id="first", submit=0)
    state = CycleState.from_snapshot(snapshot(nodes, [first], busy), pol)
    assert decide(state, pol, 10.0, explain_pending=False).placements == ()
    state.queues.remove(first)
    second, small = gang(4, job_id="second", submit=1), job(4, job_id="small", submit=2)
    state.queues.add(second)
    state.queues.add(small)
    again = decide(state, pol, 20.0, explain_pending=False)
    fresh = schedule(snapshot(nodes, [second, small], busy), pol, 20.0, random.Random(0))
    assert again.placements == fresh.placements == ()
    assert fresh.pending[JobId("small")].codes[0] is ReasonCode.CAPACITY_RESERVED
