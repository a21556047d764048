"""The packing bench measures what it says: streams reach the fleet's capacity in demand, the
same seed gives the same stream, and every policy's run books devices without over-commit and
reports as unallocated exactly what its books leave free."""

from __future__ import annotations

import pytest

from bench.packing import MIXES, fleet, run, stream


def test_a_stream_reaches_capacity_and_repeats_by_seed() -> None:
    nodes = fleet()
    capacity = float(sum(n.accelerators for n in nodes.values()))
    for mix in MIXES:
        jobs = stream(mix, capacity, seed=4)
        demand = sum(j.accelerators for j in jobs)
        assert capacity <= demand < capacity + 8
        assert [j.accelerators for j in stream(mix, capacity, seed=4)] == [
            j.accelerators for j in jobs
        ]
        assert any(0 < j.accelerators < 1 for j in jobs) and any(j.accelerators >= 2 for j in jobs)


def test_every_policy_books_devices_exactly() -> None:
    nodes = fleet()
    capacity = float(sum(n.accelerators for n in nodes.values()))
    jobs = stream("constrained", capacity, seed=5)[:1500]
    offered = sum(j.accelerators for j in jobs)
    for policy in ("default", "best-fit", "random-fit"):
        result = run(nodes, jobs, policy, seed=5)
        assert result["device_overcommit"] == 0
        assert result["placed"] + result["refused"] == len(jobs)
        # What was placed is what the books hold: the rest of the fleet is unallocated.
        assert abs(capacity - result["unallocated_gpus"] - result["placed_gpus"]) < 1e-6
        assert result["placed_gpus"] <= offered


def test_the_steady_state_releases_what_it_placed_and_never_over_commits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import bench.packing as packing

    monkeypatch.setattr(packing, "STEADY_HORIZON", 3.0)
    nodes = fleet()
    capacity = float(sum(n.accelerators for n in nodes.values()))
    for policy in ("default", "best-fit"):
        result = packing.steady(nodes, "multi-gpu", policy, seed=2)
        assert result["device_overcommit"] == 0
        assert 0 <= result["unallocated_gpus"] <= capacity
        # Offered 1.2 x capacity: some demand is turned away, most is not.
        assert 0 < result["refused_share"] < 0.5
