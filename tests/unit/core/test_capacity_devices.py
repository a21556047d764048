"""Per-device accounting (core/capacity.py) checked against an independent ledger: whatever
mix of fractional and whole replicas comes and goes, no device is ever over-committed, `slots`
says exactly how many more of a shape fit, the scheduler's state rebuilt from what runs (a
snapshot) equals the state kept placement by placement, and the executor's books, told the
same devices, refuse nothing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from core.capacity import MILLI, Capacity, milli
from core.model import (
    AcceleratorModel,
    Allocation,
    ClusterId,
    JobRequest,
    Node,
    NodeId,
    PriceTier,
    ReplicaPlacement,
)
from schemas.events import ReplicaAssignment
from services.executor.nodes import NodeBook
from sim.workload import _request

T4 = AcceleratorModel("T4", "turing", 16, 0.3)


def fleet(devices: list[int]) -> dict[NodeId, Node]:
    return {
        NodeId(f"n{i}"): Node(
            node_id=NodeId(f"n{i}"),
            cluster=ClusterId("c"),
            block="b",
            rack="r",
            nvlink_domain=f"nv{i}",
            accelerator=T4,
            accelerators=count,
            cpu=64,
            memory_gb=256,
            price_tier=PriceTier.ON_DEMAND,
        )
        for i, count in enumerate(devices)
    }


def request(job_id: str, accelerators: float) -> JobRequest:
    return _request(job_id, 0.0, "t", 1, accelerators)


def ledger_slots(free: list[int], accelerators: float) -> int:
    """How many replicas of this shape fit on a node with these free thousandths per device,
    by placing them one at a time (independent of `Capacity.slots`)."""
    free = list(free)
    count = 0
    while True:
        if accelerators >= 1:
            whole = [i for i, f in enumerate(free) if f == MILLI]
            if len(whole) < round(accelerators):
                return count
            for i in whole[: round(accelerators)]:
                free[i] = 0
        else:
            m = milli(accelerators)
            fits = [i for i, f in enumerate(free) if f >= m]
            if not fits:
                return count
            free[min(fits, key=lambda i: (free[i], i))] -= m
        count += 1


SHAPES = st.one_of(
    st.integers(5, 95).map(lambda p: p / 100),  # a share of one device
    st.integers(1, 4).map(float),  # whole devices
)
STEPS = st.lists(st.tuples(st.booleans(), SHAPES, st.integers(0, 3)), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(devices=st.lists(st.integers(1, 4), min_size=1, max_size=4), steps=STEPS)
def test_devices_are_never_over_committed_and_a_rebuild_sees_what_the_books_do(
    devices: list[int], steps: list[tuple[bool, float, int]]
) -> None:
    nodes = fleet(devices)
    cap = Capacity.build(nodes, {}, {})
    book = NodeBook({str(k): v for k, v in nodes.items()})
    ledger = {str(k): [MILLI] * n.accelerators for k, n in nodes.items()}
    running: dict[str, Allocation] = {}
    for seq, (arrive, accelerators, pick) in enumerate(steps):
        if arrive:
            node_id = NodeId(f"n{pick % len(devices)}")
            node = cap.index[node_id]
            fit = int(cap.slots(np.array([node]), accelerators, 0.0, 0.0)[0])
            assert fit == ledger_slots(ledger[node_id], accelerators)
            if fit == 0:
                continue
            taken = cap.take(node, accelerators, 0.0, 0.0)
            for d in taken:
                ledger[node_id][d] -= MILLI if accelerators >= 1 else milli(accelerators)
                assert ledger[node_id][d] >= 0, f"device {d} of {node_id} over-committed"
            placed = ReplicaPlacement(0, node_id, accelerators, 0.0, 0.0, taken)
            job_id = f"j{seq}"
            running[job_id] = Allocation(
                request(job_id, accelerators), ClusterId("c"), (placed,), 0
            )
            # The executor, told the devices, books exactly them and refuses nothing.
            assignment = [
                ReplicaAssignment(
                    replica=0,
                    node_id=node_id,
                    accelerators=accelerators,
                    cpu=0.0,
                    memory_gb=0.0,
                    devices=list(taken),
                )
            ]
            assert book.check(assignment) is None
            book.allocate(job_id, assignment)
        elif running:
            job_id = sorted(running)[pick % len(running)]
            alloc = running.pop(job_id)
            cap.release(alloc.replicas, alloc.job)
            (r,) = alloc.replicas
            for d in r.devices:
                ledger[r.node_id][d] += MILLI if r.accelerators >= 1 else milli(r.accelerators)
            assert book.release(job_id)
        # The state kept step by step equals one rebuilt from what runs now, device by device.
        rebuilt = Capacity.build(nodes, {}, {})
        rebuilt.charge(running.values())
        assert np.array_equal(rebuilt.device_used, cap.device_used)
        assert np.array_equal(rebuilt.free_whole, cap.free_whole)
        for node_id, free in ledger.items():
            i = cap.index[NodeId(node_id)]
            assert [MILLI - int(u) for u in cap.device_used[i, : len(free)]] == free
            assert book.use[node_id].devices == free
            assert cap.free_total[i] == sum(free) / MILLI
        assert book.audit() == []


def test_the_issues_node_a_rebuild_once_saw_room_on() -> None:
    """A T4 x 2 node holding 0.37, 0.47, 0.47 and 0.32 placed in that order has 0.16 and 0.21
    free; a state rebuilt from them must not see room for 0.23 (it once re-packed them
    largest-first and found 0.31)."""
    nodes = fleet([2])
    cap = Capacity.build(nodes, {}, {})
    running = []
    for i, share in enumerate((0.37, 0.47, 0.47, 0.32)):
        taken = cap.take(0, share, 0.0, 0.0)
        placed = ReplicaPlacement(0, NodeId("n0"), share, 0.0, 0.0, taken)
        running.append(Allocation(request(f"j{i}", share), ClusterId("c"), (placed,), 0))
    assert sorted(MILLI - int(u) for u in cap.device_used[0, :2]) == [160, 210]
    rebuilt = Capacity.build(nodes, {}, {})
    rebuilt.charge(running)
    assert int(rebuilt.slots(np.array([0]), 0.23, 0.0, 0.0)[0]) == 0
    # Without named devices (placements from before), the old packing rule still applies.
    legacy = Capacity.build(nodes, {}, {})
    legacy.charge([replace(a, replicas=(replace(a.replicas[0], devices=()),)) for a in running])
    assert int(legacy.free_milli[0]) == 370


def test_named_devices_a_node_does_not_have_are_never_indexed() -> None:
    """A placement naming devices past the node's (a careless producer, or a node that lost
    devices since), or the same device twice, or too few, is charged by the packing rule:
    nothing raises and nothing lands outside the node."""
    nodes = fleet([2, 8])
    cap = Capacity.build(nodes, {}, {})
    for bad in ((4000,), (2,), (0, 0), (0,)):
        taken = cap.take(0, 2.0 if len(bad) == 2 else 1.0, 0.0, 0.0, bad)
        assert all(0 <= d < 2 for d in taken)
        cap.give(0, 2.0 if len(bad) == 2 else 1.0, 0.0, 0.0, bad)
    assert int(cap.free_milli[0]) == 2 * MILLI and int(cap.free_whole[0]) == 2
    # The padding past a 2-device node (the fleet's widest has 8) is never touched.
    assert (cap.device_used[0, 2:] == MILLI).all()


def test_shares_are_counted_to_the_nearest_thousandth_and_thirds_share_a_device() -> None:
    """Thousandths to the nearest: three thirds (333 each) share one device, as three
    replicas of 1/3 always have, in the scheduler's books and the executor's; sixteen
    sixteenths too; a fourth third does not fit."""
    assert milli(1 / 3) == 333 and milli(0.1 + 0.2) == 300 and milli(0.0004) == 1
    assert milli(1 / 16) == 62
    nodes = fleet([1])
    cap = Capacity.build(nodes, {}, {})
    assert int(cap.slots(np.array([0]), 1 / 3, 0.0, 0.0)[0]) == 3
    assert int(cap.slots(np.array([0]), 1 / 16, 0.0, 0.0)[0]) == 16
    book = NodeBook({str(k): v for k, v in nodes.items()})
    for i in range(3):
        one = [ReplicaAssignment(replica=0, node_id="n0", accelerators=1 / 3, cpu=0, memory_gb=0)]
        assert book.check(one) is None
        book.allocate(f"j{i}", one)
    fourth = [ReplicaAssignment(replica=0, node_id="n0", accelerators=1 / 3, cpu=0, memory_gb=0)]
    assert book.check(fourth) is not None


def test_running_work_on_a_node_left_with_no_devices_charges_none_and_raises_nothing() -> None:
    """A 1-GPU node whose device plugin now offers none still runs a 0.5 replica: a rebuild
    charges its CPU and memory, no device, every cycle, without raising."""
    nodes = fleet([0, 2])
    cap = Capacity.build(nodes, {}, {})
    assert cap.take(0, 0.5, 1.0, 1.0, (0,)) == ()
    assert cap.take(0, 0.5, 1.0, 1.0) == ()
    assert cap.take(0, 1.0, 1.0, 1.0) == ()
    assert int(cap.free_milli[0]) == 0 and float(cap.free_cpu[0]) == 61.0
