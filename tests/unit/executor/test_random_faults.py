"""The seeded random fault mode: the same seed gives the same faults on the same nodes, the
faults are what the health rules call critical or transient, and the mode starts, replays and
stops on request."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import pytest
import yaml

from schemas.health import SignalKind
from services.executor.random_faults import (
    Fault,
    FaultKind,
    RandomFaults,
    choose_fault,
    next_fault_in_s,
    seeded,
)
from services.health.rules import HealthRules

ROOT = Path(__file__).resolve().parents[3]
NODES = {f"c-h100-{i:04d}": 8 for i in range(12)}


def sequence(seed: int, count: int = 50, nodes: dict[str, int] = NODES) -> list[Fault]:
    rng = random.Random(seed)
    return [choose_fault(rng, nodes) for _ in range(count)]


def test_the_same_seed_chooses_the_same_faults_on_the_same_nodes() -> None:
    assert sequence(42) == sequence(42)
    assert [(f.node_id, f.kind) for f in sequence(42)] != [
        (f.node_id, f.kind) for f in sequence(43)
    ]


def test_the_order_nodes_are_listed_in_does_not_matter() -> None:
    shuffled = dict(reversed(list(NODES.items())))
    assert sequence(7, nodes=shuffled) == sequence(7)


def test_every_kind_occurs_on_nodes_of_the_cluster() -> None:
    faults = sequence(3, count=600)
    kinds = Counter(f.kind for f in faults)
    assert set(kinds) == set(FaultKind)
    assert kinds[FaultKind.CRITICAL_XID] < kinds[FaultKind.TRANSIENT_BURST]  # weights 0.2 / 0.4
    assert {f.node_id for f in faults} == set(NODES)
    for f in faults:
        if f.kind is FaultKind.STRAGGLER:
            assert 2 <= f.factor <= 4 and f.for_s > 0 and not f.signals
        else:
            assert f.signals and all(0 <= s.device < 8 for s in f.signals if s.device is not None)


def test_the_health_rules_see_critical_faults_as_critical_and_bursts_as_transient() -> None:
    rules = HealthRules.from_dict(yaml.safe_load((ROOT / "examples" / "health.yaml").read_text()))
    for f in sequence(11, count=300):
        for s in f.signals:
            rule = rules.match(s.kind, s.xid)
            assert rule is not None, s
            if f.kind is FaultKind.CRITICAL_XID:
                assert rule.critical and s.kind is SignalKind.GPU_XID and s.xid == 79
            else:
                assert not rule.critical and len(f.signals) <= rule.threshold, (f, rule)


def test_waits_follow_the_rate() -> None:
    rng = random.Random(5)
    waits = [next_fault_in_s(rng, 6.0) for _ in range(4000)]  # six an hour: ten minutes apart
    assert 540 < sum(waits) / len(waits) < 660


def test_one_seed_on_several_clusters_does_not_fault_them_in_lockstep() -> None:
    a, b = seeded(1, "cluster-a"), seeded(1, "cluster-b")
    assert [a.random() for _ in range(5)] != [b.random() for _ in range(5)]
    assert seeded(1, "cluster-a").random() == seeded(1, "cluster-a").random()


async def run_mode(rate: float, seed: int, count: int) -> tuple[RandomFaults, list[Fault]]:
    got: list[Fault] = []
    enough = asyncio.Event()

    async def inject(fault: Fault) -> None:
        got.append(fault)
        if len(got) >= count:
            enough.set()

    # 36,000 faults per fleet hour at 1x: one every 0.1 s on average, fast enough for a test.
    mode = RandomFaults("c", NODES, inject, time_scale=1.0)
    task = asyncio.create_task(mode.run_forever())
    try:
        mode.configure(rate, seed)
        await asyncio.wait_for(enough.wait(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return mode, got[:count]


async def test_the_mode_replays_its_sequence_and_stops_at_rate_zero() -> None:
    _, first = await run_mode(36_000, seed=9, count=5)
    mode, again = await run_mode(36_000, seed=9, count=5)
    assert first == again
    assert mode.injected >= 5

    got: list[Fault] = []

    async def inject(fault: Fault) -> None:
        got.append(fault)

    stopped = RandomFaults("c", NODES, inject, time_scale=1.0)
    task = asyncio.create_task(stopped.run_forever())
    stopped.configure(3_600_000, seed=1)
    await asyncio.sleep(0.2)
    stopped.configure(0, seed=1)
    await asyncio.sleep(0.05)
    count = len(got)
    await asyncio.sleep(0.3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert count > 0 and len(got) == count


def test_an_empty_cluster_has_nothing_to_fault() -> None:
    with pytest.raises(ValueError):
        choose_fault(random.Random(1), {})
