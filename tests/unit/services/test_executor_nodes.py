"""The executor's over-commit guard, down to shared devices."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.model import AcceleratorModel, ClusterId, Node, NodeId
from schemas.events import ReplicaAssignment
from services.executor.nodes import NodeBook

H100 = AcceleratorModel("H100", "hopper", 80, 3.0)


def nodes(count: int, gpus: int = 8) -> dict[str, Node]:
    return {
        f"n{i}": Node(NodeId(f"n{i}"), ClusterId("c"), "b0", "r0", f"d{i}", H100, gpus, 64, 512)
        for i in range(count)
    }


def rep(
    node: str, gpus: float, replica: int = 0, cpu: float = 1, mem: float = 1
) -> ReplicaAssignment:
    return ReplicaAssignment(
        replica=replica, node_id=node, accelerators=gpus, cpu=cpu, memory_gb=mem
    )


def test_a_gang_that_fits_is_allocated_and_released() -> None:
    book = NodeBook(nodes(2))
    gang = [rep("n0", 8), rep("n1", 8, replica=1)]
    assert book.check(gang) is None
    book.allocate("j", gang)
    assert book.check([rep("n0", 1)]) is not None
    assert book.release("j")
    assert book.check([rep("n0", 8)]) is None


def test_refusal_names_the_node_and_the_numbers() -> None:
    book = NodeBook(nodes(1))
    book.allocate("j", [rep("n0", 6)])
    why = book.check([rep("n0", 4)])
    assert why is not None and "n0" in why and "2 whole H100 free of 8" in why


def test_two_replicas_of_one_gang_cannot_share_what_is_not_there() -> None:
    book = NodeBook(nodes(1))
    assert book.check([rep("n0", 6), rep("n0", 6, replica=1)]) is not None


def test_fractions_share_a_device_until_it_is_full() -> None:
    book = NodeBook(nodes(1, gpus=1))
    book.allocate("a", [rep("n0", 0.5)])
    book.allocate("b", [rep("n0", 0.25)])
    assert book.check([rep("n0", 0.5)]) is not None
    assert book.check([rep("n0", 0.25)]) is None
    assert book.check([rep("n0", 1)]) is not None


def test_cpu_and_memory_are_guarded_too() -> None:
    book = NodeBook(nodes(1))
    assert "CPU" in (book.check([rep("n0", 1, cpu=65)]) or "")
    assert "memory" in (book.check([rep("n0", 1, mem=513)]) or "")


def test_unknown_nodes_are_refused() -> None:
    assert "not in this cluster" in (NodeBook(nodes(1)).check([rep("zz", 1)]) or "")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from([0.25, 0.5, 1, 2, 4, 8])),
        min_size=1,
        max_size=40,
    )
)
def test_whatever_is_asked_the_books_never_overcommit(asks: list[tuple[int, float]]) -> None:
    book = NodeBook(nodes(3))
    for i, (node, gpus) in enumerate(asks):
        replicas = [rep(f"n{node}", gpus)]
        if book.check(replicas) is None:
            book.allocate(f"j{i}", replicas)
        assert book.audit() == []
        if i % 3 == 2:
            book.release(f"j{i - 1}")
    assert all(u.allocated_accelerators <= u.node.accelerators + 1e-9 for u in book.use.values())


class _Untouchable:
    """A node's books that fail when read: a check must not read nodes its gang is not on."""

    @property
    def devices(self) -> list[int]:
        raise AssertionError("read a node the gang is not on")

    node = devices


def test_a_check_reads_only_the_nodes_its_gang_is_on() -> None:
    # Copying every node's books for each check made it cost what the cluster's size does.
    book = NodeBook(nodes(4))
    book.use["n3"] = _Untouchable()  # type: ignore[assignment]
    gang = [rep("n0", 4), rep("n1", 8, replica=1), rep("n0", 4, replica=2)]
    assert book.check(gang) is None
    assert book.check([*gang, rep("n0", 1, replica=3)]) is not None  # n0 is full by then


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.integers(0, 2), st.sampled_from([0.25, 0.5, 1, 2, 4, 8])),
            min_size=1,
            max_size=4,
        ),
        min_size=1,
        max_size=20,
    )
)
def test_a_gang_is_refused_exactly_when_its_replicas_together_do_not_fit(
    gangs: list[list[tuple[int, float]]],
) -> None:
    """Replicas of one gang on the same node count against each other; the verdict matches
    booking them one by one on a copy of the books."""
    book = NodeBook(nodes(3))
    for i, asks in enumerate(gangs):
        replicas = [rep(f"n{node}", gpus, replica=k) for k, (node, gpus) in enumerate(asks)]
        trial = NodeBook(nodes(3))
        for job_id, held in book.by_job.items():
            trial.by_job[job_id] = held
            for node_id, taken, cpu, mem in held:
                use = trial.use[node_id]
                for d, amount in taken:
                    use.devices[d] -= amount
                use.cpu += cpu
                use.memory_gb += mem
        fits = True
        for k, r in enumerate(replicas):
            if trial.check([r]) is not None:
                fits = False
                break
            trial.allocate(f"probe{k}", [r])
        assert (book.check(replicas) is None) == fits
        if fits:
            book.allocate(f"j{i}", replicas)
        assert book.audit() == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from([0.25, 0.5, 1, 2, 4, 8]), st.integers(0, 9)),
        min_size=1,
        max_size=40,
    )
)
def test_the_cluster_total_booked_follows_every_booking(asks: list[tuple[int, float, int]]) -> None:
    """The gauge's total is kept as bookings come and go; it equals summing every node."""
    book = NodeBook(nodes(3))
    for i, (node, gpus, other) in enumerate(asks):
        replicas = [rep(f"n{node}", gpus)]
        if book.check(replicas) is None:
            book.allocate(f"j{i}", replicas)
        if other < 3:
            book.release(f"j{other * 5}")
        elif other == 9:  # the node reported again with fewer devices (booked ones stay)
            book.upsert(replace(book.use[f"n{node}"].node, accelerators=4))
        total = sum(u.allocated_accelerators for u in book.use.values())
        assert book.allocated_accelerators == pytest.approx(total, abs=1e-9)
