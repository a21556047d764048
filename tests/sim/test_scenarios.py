"""Scenario tests: small workloads through the simulator, results within expected ranges."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from core.policy import Policy
from sim.engine import Simulation
from sim.fleet import pool_fleet
from sim.report import offered_load, summarize
from sim.runner import compare
from sim.workload import (
    SimJob,
    Window,
    _request,
    gang_shape,
    load_generic,
    load_philly,
    write_generic,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def synthetic(n: int, seed: int, pool_gpus: float, load: float) -> list[SimJob]:
    """Philly-like mix: mostly 1-GPU jobs, heavy-tailed durations, a few whole-node gangs."""
    rng = random.Random(seed)
    sizes = [1] * 80 + [2] * 6 + [4] * 6 + [8] * 5 + [16] * 3
    specs = []
    for i in range(n):
        gpus = rng.choice(sizes)
        duration = min(rng.lognormvariate(7.0, 1.6), 200_000.0)
        specs.append((i, gpus, duration))
    demand = sum(g * d for _, g, d in specs)
    span = demand / (pool_gpus * load)
    jobs = []
    for i, gpus, duration in specs:
        replicas, per = gang_shape(gpus)
        request = _request(f"s{i:05d}", rng.uniform(0, span), f"t{i % 4}", replicas, per)
        jobs.append(SimJob(request, duration))
    return sorted(jobs, key=lambda j: (j.request.submit_time, j.request.job_id))


@pytest.fixture(scope="module")
def comparison():  # type: ignore[no-untyped-def]
    jobs = synthetic(1500, seed=3, pool_gpus=64, load=0.9)
    return compare(
        lambda p: pool_fleet("8x8", p),
        Policy.default(),
        jobs,
        ["fifo", "fifo-backfill", "default", "las"],
    )


def test_every_job_finishes_without_overcommit(comparison) -> None:  # type: ignore[no-untyped-def]
    for summary in comparison.summaries.values():
        assert summary["finished"] == summary["jobs"] == 1500
        assert summary["overcommit"] == 0


def test_backfill_and_smarter_policies_beat_strict_fifo(comparison) -> None:  # type: ignore[no-untyped-def]
    s = comparison.summaries
    fifo = s["fifo"]["avg_jct_s"]
    assert s["fifo-backfill"]["avg_jct_s"] < 0.8 * fifo
    assert s["default"]["avg_jct_s"] < 0.8 * fifo
    assert s["las"]["avg_jct_s"] < s["fifo-backfill"]["avg_jct_s"]
    assert s["las"]["preemptions"] > 0 and s["fifo"]["preemptions"] == 0


def test_utilization_while_backlogged_is_high(comparison) -> None:  # type: ignore[no-untyped-def]
    for name in ("fifo-backfill", "default"):
        assert 0.8 <= comparison.summaries[name]["utilization_backlog"] <= 1.0 + 1e-9


def test_same_seed_same_results() -> None:
    jobs = synthetic(300, seed=5, pool_gpus=32, load=0.9)
    runs = []
    for _ in range(2):
        clusters, nodes = pool_fleet("4x8", Policy.default())
        sim = Simulation(clusters, nodes, Policy.default(), jobs)
        records = sim.run()
        runs.append({k: (r.first_start, r.finish) for k, r in records.items()})
    assert runs[0] == runs[1]


def test_quotas_steer_shares_towards_entitlement() -> None:
    # Two tenants with equal, long backlogs and quotas 24:8 on a 32-GPU pool. Over the whole run
    # each gets half (equal work); while both are backlogged, the split must follow the quotas.
    rng = random.Random(9)
    jobs = [
        SimJob(_request(f"q{i:04d}", rng.uniform(0, 2000), tenant, 1, 1), 3000.0)
        for i, tenant in enumerate(["big", "small"] * 400)
    ]
    run = compare(
        lambda p: pool_fleet("4x8", p),
        Policy.default(),
        jobs,
        ["default"],
        entitlement={"big": 24.0, "small": 8.0},
    )
    tenants = run.summaries["default"]["tenants"]
    assert tenants["big"]["entitlement"] == pytest.approx(0.75)
    early = [
        r
        for r in run.records["default"].values()
        if r.first_start is not None and 3000 <= r.first_start < 30_000
    ]
    big = sum(r.job.request.tenant == "big" for r in early) / len(early)
    assert 0.65 <= big <= 0.85


def test_generic_csv_round_trip(tmp_path: Path) -> None:
    jobs = synthetic(20, seed=1, pool_gpus=8, load=0.5)
    write_generic(tmp_path / "w.csv", jobs)
    again = load_generic(tmp_path / "w.csv")
    assert [(j.request.job_id, j.request.replicas, j.duration_s) for j in again] == [
        (j.request.job_id, j.request.replicas, j.duration_s) for j in jobs
    ]
    assert 0.4 < offered_load(again, 8.0) < 0.6


def test_philly_window_loads_and_replays() -> None:
    philly = TRACES / "philly.csv"
    if not philly.exists():
        pytest.skip(f"{philly} not found; see shared/traces/README.md")
    jobs = load_philly(philly, Window.parse("2017-10-02:2017-10-02"))
    assert 500 < len(jobs) < 3000
    clusters, nodes = pool_fleet("16x8", Policy.default())
    sim = Simulation(clusters, nodes, Policy.default(), jobs)
    summary = summarize(sim.run(), sim.trace)
    assert summary["finished"] == len(jobs) and summary["overcommit"] == 0
