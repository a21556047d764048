"""The simulator must run the live scheduler's policy, not a look-alike: on every cycle of a
replay, its long-lived, incrementally kept state and fast path decide exactly what
`core.cycle.schedule` decides on a snapshot of the same moment (what the live scheduler does)."""

from __future__ import annotations

import random

import pytest

from core.cycle import CycleResult, CycleState, decide, schedule
from core.model import Snapshot
from core.policy import Policy
from sim import engine
from sim.engine import Simulation
from sim.fleet import pool_fleet
from sim.report import summarize
from sim.variants import variant, with_quotas
from tests.sim.test_scenarios import synthetic


@pytest.mark.parametrize("name", ["fifo", "fifo-backfill", "default", "las", "quotas"])
def test_every_cycle_decides_like_a_fresh_snapshot(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name == "quotas":
        pol = with_quotas(Policy.default(), {"t0": 16.0, "t1": 8.0, "t2": 8.0})
    else:
        pol = variant(Policy.default(), name)
    jobs = synthetic(250, seed=11, pool_gpus=32, load=1.2)
    clusters, nodes = pool_fleet("4x8", pol)
    sim = Simulation(clusters, nodes, pol, jobs)
    checked = 0

    def checked_decide(state: CycleState, policy: Policy, now: float, **kw: bool) -> CycleResult:
        nonlocal checked
        snap = Snapshot(
            clusters=clusters,
            nodes=nodes,
            running=dict(state.running),
            pending=list(state.queues.jobs()),
            usage=dict(sim.usage),
            attained={j: state.attained[j] for j in state.attained},
        )
        expected = schedule(snap, policy, now, random.Random(0))
        result = decide(state, policy, now, **kw)
        assert result.placements == expected.placements
        assert result.preemptions == expected.preemptions
        checked += 1
        return result

    monkeypatch.setattr(engine, "decide", checked_decide)
    summary = summarize(sim.run(), sim.trace)
    assert summary["finished"] == 250 and checked > 100
    if name in ("las", "quotas"):
        assert summary["preemptions"] > 0
