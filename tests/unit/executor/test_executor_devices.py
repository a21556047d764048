"""The executor's device books (services/executor/nodes.py): a replica naming its devices is
booked exactly there or refused with the reason; a node that stopped offering devices is never
booked past the ones it has, even while a booked one lingers at the end."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from core.model import AcceleratorModel, ClusterId, Node, NodeId, PriceTier
from schemas.events import ReplicaAssignment
from services.executor.nodes import NodeBook

A100 = AcceleratorModel("A100", "ampere", 40, 1.6)


def node(devices: int) -> Node:
    return Node(
        node_id=NodeId("n"),
        cluster=ClusterId("c"),
        block="b",
        rack="r",
        nvlink_domain="nv",
        accelerator=A100,
        accelerators=devices,
        cpu=64,
        memory_gb=512,
        price_tier=PriceTier.ON_DEMAND,
    )


def replica(accelerators: float, devices: list[int] | None = None) -> list[ReplicaAssignment]:
    return [
        ReplicaAssignment(
            replica=0,
            node_id="n",
            accelerators=accelerators,
            cpu=1,
            memory_gb=1,
            devices=devices or [],
        )
    ]


def test_named_devices_are_booked_exactly_or_refused_with_why() -> None:
    book = NodeBook({"n": node(4)})
    book.allocate("a", replica(0.5, [2]))
    assert book.use["n"].devices == [1000, 1000, 500, 1000]
    assert "device 2 has 0.5 free" in (book.check(replica(0.6, [2])) or "")
    assert "not free" in (book.check(replica(2, [1, 2])) or "")
    assert book.check(replica(2, [0, 1])) is None


def test_a_node_that_lost_devices_is_never_booked_past_them() -> None:
    book = NodeBook({"n": node(4)})
    book.allocate("last", replica(1, [3]))
    book.upsert(replace(node(2)))  # the device plugin now offers 2; device 3 stays booked
    assert len(book.use["n"].devices) == 4
    assert "not on the node" in (book.check(replica(1, [2])) or "")
    # Unnamed, only the node's devices are used: two fit, three do not.
    assert book.check(replica(2)) is None
    assert book.check(replica(3)) is not None


def test_a_whole_replica_naming_devices_asks_a_whole_number() -> None:
    with pytest.raises(ValidationError, match="whole numbers"):
        replica(2.5, [0, 1])
    with pytest.raises(ValidationError, match="names 1 devices"):
        replica(2, [0])
    with pytest.raises(ValidationError, match="distinct"):
        replica(2, [1, 1])


def test_no_replica_can_credit_the_books_with_a_negative_amount() -> None:
    """A placement from a careless or hostile producer asking -64 CPU would free CPU others
    hold; the event is refused as invalid before it reaches the books."""
    for field, value in (("cpu", -64.0), ("memory_gb", -1.0), ("accelerators", -1.0)):
        raw = {"replica": 0, "node_id": "n", "accelerators": 1.0, "cpu": 1.0, "memory_gb": 1.0}
        with pytest.raises(ValidationError, match="greater than or equal to 0"):
            ReplicaAssignment.model_validate({**raw, field: value})
