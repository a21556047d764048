"""The simulator must run the live scheduler's policy, not a look-alike: on every cycle of a
replay, its long-lived, incrementally kept state and fast path decide exactly what
`core.cycle.schedule` decides on a snapshot of the same moment (what the live scheduler does)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from core.cycle import CycleResult, CycleState, decide, schedule
from core.fleet import load_fleet
from core.model import Snapshot
from core.policy import LevelMode, Policy, ServiceLevels
from core.service import Levels
from sim import engine
from sim.engine import Simulation
from sim.fleet import pool_fleet
from sim.report import summarize
from sim.variants import variant, with_quotas
from sim.workload import SimJob, _request, gang_shape
from tests.sim.test_scenarios import synthetic


def mixed(n: int, seed: int, pool_gpus: float, load: float) -> list[SimJob]:
    """Mostly fractional work (shares of 0.05-0.95 of a device, as in GPU-sharing traces) with
    whole-device jobs and gangs among it."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        if rng.random() < 0.7:
            replicas, per = rng.choice([1, 1, 1, 2, 3]), rng.randint(5, 95) / 100
        else:
            replicas, per = gang_shape(rng.choice([1, 1, 2, 4, 8, 16]))
        specs.append((i, replicas, per, min(rng.lognormvariate(6.5, 1.4), 50_000.0)))
    span = sum(r * a * d for _, r, a, d in specs) / (pool_gpus * load)
    jobs = [
        SimJob(_request(f"m{i:05d}", rng.uniform(0, span), f"t{i % 3}", r, a), d)
        for i, r, a, d in specs
    ]
    return sorted(jobs, key=lambda j: (j.request.submit_time, j.request.job_id))


def typed(n: int, seed: int) -> list[SimJob]:
    """The mixed work of `mixed`, a third of it restricted to one accelerator type that can
    hold it, for the three-type fleet of `typed_fleet` (placement then keeps room of a type
    for the work that needs it)."""
    rng = random.Random(seed * 31)
    out = []
    for sim_job in mixed(n, seed, pool_gpus=48, load=1.2):
        request = sim_job.request
        fits = [
            t for t, per in (("H100", 8), ("A100", 8), ("L4", 4)) if per >= request.accelerators
        ]
        if rng.random() < 0.33:
            request = replace(request, accelerator_types=(rng.choice(fits),))
        out.append(SimJob(request, sim_job.duration_s))
    return out


def typed_fleet(pol: Policy) -> tuple[dict, dict]:
    groups = [
        ("h", "H100", 2, 8),
        ("a", "A100", 2, 8),
        ("l", "L4", 4, 4),
    ]
    doc = {
        "clusters": [
            {
                "name": "pool",
                "location": "sim",
                "kind": "on_prem",
                "node_groups": [
                    {
                        "prefix": prefix,
                        "count": count,
                        "accelerator_type": type_name,
                        "accelerators_per_node": per,
                        "nodes_per_rack": 4,
                        "racks_per_block": 4,
                    }
                    for prefix, type_name, count, per in groups
                ],
            }
        ]
    }
    return load_fleet(doc, pol.accelerator_types)


@pytest.mark.parametrize(
    "name,work",
    [
        ("fifo", "whole"),
        ("fifo-backfill", "whole"),
        ("default", "whole"),
        ("las", "whole"),
        ("quotas", "whole"),
        ("default", "mixed"),
        ("las", "mixed"),
        ("fifo-backfill", "mixed"),
        ("learned", "whole"),
        ("learned", "mixed"),
        ("repack", "whole"),
        ("repack", "mixed"),
        ("default", "typed"),
        ("las", "typed"),
    ],
)
def test_every_cycle_decides_like_a_fresh_snapshot(
    name: str, work: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With whole devices, and with mostly fractional work: the snapshot rebuild charges
    each running replica on the devices its placement named, so the two agree device by
    device (it once re-packed fractions and saw room the executor would refuse)."""
    if name == "quotas":
        pol = with_quotas(Policy.default(), {"t0": 16.0, "t1": 8.0, "t2": 8.0})
    elif name == "learned":
        # Levels learned from the jobs that finished so far: the kept queue re-levels its jobs
        # when that history moves on, and must then order as a queue built afresh.
        pol = replace(
            Policy.from_dict({"preemption": {"min_runtime_s": 600}}),
            service_levels=ServiceLevels(mode=LevelMode.LEARNED, min_samples=4),
        )
    elif name == "repack":
        # Small jobs moved for long-waiting big ones: the moves are preemptions of their own.
        pol = Policy.from_dict(
            {"preemption": {"repack": True, "repack_after_s": 300, "min_runtime_s": 300}}
        )
    else:
        pol = variant(Policy.default(), name)
    if work == "mixed":
        jobs = mixed(400, seed=5, pool_gpus=32, load=1.2)
    elif work == "typed":
        jobs = typed(400, seed=5)
    else:
        jobs = synthetic(250, seed=11, pool_gpus=32, load=1.2)
    clusters, nodes = typed_fleet(pol) if work == "typed" else pool_fleet("4x8", pol)
    sim = Simulation(clusters, nodes, pol, jobs)
    checked = 0
    claims_seen = False

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
        levels = Levels(policy, state.levels.history)
        # What type-restricted work holds per type is kept exactly, as a rebuild counts it.
        fresh = CycleState.from_snapshot(snap, policy, levels)
        assert (fresh.cap.type_claimed_milli == state.cap.type_claimed_milli).all()
        assert (fresh.cap.type_free_milli == state.cap.type_free_milli).all()
        nonlocal claims_seen
        claims_seen = claims_seen or bool(state.cap.type_claimed_milli.any())
        expected = schedule(snap, policy, now, random.Random(0), levels)
        result = decide(state, policy, now, **kw)
        assert result.placements == expected.placements
        assert result.preemptions == expected.preemptions
        checked += 1
        return result

    monkeypatch.setattr(engine, "decide", checked_decide)
    summary = summarize(sim.run(), sim.trace)
    assert summary["finished"] == len(jobs) and checked > 100
    # No node and no device past what it has, by the simulator's own per-device ledger.
    assert summary["overcommit"] == 0
    if name in ("las", "quotas", "learned", "repack"):
        assert summary["preemptions"] > 0
    if name == "learned":
        assert sim.state.levels.history.epoch > 10
    assert claims_seen == (work == "typed")
