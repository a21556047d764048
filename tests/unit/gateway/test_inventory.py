"""Folding cluster.capacity and the health verdicts into the fleet tables' writes: the newest
inventory per cluster, the newest verdict per node, and hostile records dead-lettered (or left
to the pools reader, which dead-letters the same unreadable cluster.capacity records)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import ClusterCapacity, NodeInfo
from schemas.health import NodeRecovered, NodeUnhealthy
from services.gateway.inventory import fleet_writes
from tests.unit.gateway.builders import record
from tests.unit.services.builders import T0


def node(node_id: str, **over: Any) -> NodeInfo:
    fields: dict[str, Any] = {
        "node_id": node_id,
        "block": "b0",
        "rack": "r0",
        "nvlink_domain": node_id,
        "accelerator_type": "H100",
        "generation": "hopper",
        "accelerator_memory_gb": 80,
        "relative_speed": 3,
        "accelerators": 8,
        "cpu": 96,
        "memory_gb": 1024,
        "price_tier": "on_demand",
        **over,
    }
    return NodeInfo.model_validate(fields)


def capacity(cluster: str, *nodes: NodeInfo) -> ClusterCapacity:
    return ClusterCapacity(
        cluster=cluster, location="x", kind="on_prem", prices={}, nodes=list(nodes)
    )


def raw(event_type: str, payload: BaseModel | dict[str, Any], seconds: float = 0) -> bytes:
    body = payload if isinstance(payload, dict) else payload.model_dump(mode="json")
    env = Envelope(type=event_type, occurred_at=T0 + timedelta(seconds=seconds), payload=body)
    return env.model_dump_json().encode()


def down(node_id: str, incident: str = "i1") -> NodeUnhealthy:
    return NodeUnhealthy(
        node_id=node_id,
        cluster="c1",
        cause="xid_79",
        signals=["gpu_xid 79 on device 3"],
        since=T0,
        incident_id=incident,
    )


def up(node_id: str, incident: str = "i1") -> NodeRecovered:
    return NodeRecovered(
        node_id=node_id,
        cluster="c1",
        cause="xid_79",
        unhealthy_since=T0,
        recovered_at=T0 + timedelta(minutes=5),
        incident_id=incident,
        signals_seen=2,
    )


def test_the_newest_inventory_of_each_cluster_wins() -> None:
    batch = [
        record(topics.CLUSTER_CAPACITY, raw("ClusterCapacity", capacity("c1", node("a")), 10), 0),
        record(topics.CLUSTER_CAPACITY, raw("ClusterCapacity", capacity("c1", node("b")), 5), 1),
        record(topics.CLUSTER_CAPACITY, raw("ClusterCapacity", capacity("c2", node("z")), 1), 2),
        record(topics.AUTOSCALE_DECIDED, b"not json", 3),  # another reader's topic: left alone
    ]
    writes = fleet_writes(batch)
    assert writes.dead == []
    assert {c: [n[0] for n in inv.nodes] for c, inv in writes.inventories.items()} == {
        "c1": ["a"],
        "c2": ["z"],
    }


def test_a_node_listed_twice_is_one_row() -> None:
    twice = capacity("c1", node("a", accelerators=4), node("a", accelerators=8))
    writes = fleet_writes([record(topics.CLUSTER_CAPACITY, raw("ClusterCapacity", twice))])
    (row,) = writes.inventories["c1"].nodes
    assert row[7] == 8  # the last listing


def test_the_newest_verdict_decides_and_a_recovery_wins_a_tie() -> None:
    later = [
        record(topics.NODE_RECOVERED, raw("NodeRecovered", up("n1"), 300), 0),
        record(topics.NODE_UNHEALTHY, raw("NodeUnhealthy", down("n1"), 0), 0),
        record(topics.NODE_UNHEALTHY, raw("NodeUnhealthy", down("n2"), 7), 1),
        record(topics.NODE_RECOVERED, raw("NodeRecovered", up("n2"), 7), 1),
    ]
    writes = fleet_writes(later)
    assert len(writes.verdicts) == 4
    assert [(v.node_id, v.quarantined) for v in writes.health] == [("n1", False), ("n2", False)]
    assert "2 bad signal(s)" in writes.verdicts[0].detail


def test_a_verdict_about_a_node_no_inventory_lists_is_kept() -> None:
    # The inventory naming it may come later (another topic); the tables forget it after a day.
    writes = fleet_writes([record(topics.NODE_UNHEALTHY, raw("NodeUnhealthy", down("ghost")))])
    assert [v.node_id for v in writes.health] == ["ghost"] and writes.dead == []


def test_hostile_records() -> None:
    def claiming(cluster: str, accelerators: bytes) -> bytes:
        good = raw("ClusterCapacity", capacity(cluster, node("a"), node("b", accelerators=7)))
        return good.replace(b'"accelerators":7', b'"accelerators":' + accelerators)

    huge, negative = claiming("c1", b"1000000000"), claiming("c2", b"-8")
    assert b"1000000000" in huge and b"-8" in negative
    nan = raw("ClusterCapacity", capacity("c3", node("d"))).replace(b'"cpu":96.0', b'"cpu":NaN')
    assert b"NaN" in nan
    batch = [
        record(topics.CLUSTER_CAPACITY, huge, 0),
        record(topics.CLUSTER_CAPACITY, negative, 1),
        record(topics.CLUSTER_CAPACITY, nan, 2),
        record(topics.CLUSTER_CAPACITY, b"\xff garbage", 3),
        record(topics.CLUSTER_CAPACITY, raw("ClusterCapacity", {"cluster": "c4"}), 4),
        record(topics.NODE_UNHEALTHY, b"{not json", 5),
        record(topics.NODE_UNHEALTHY, raw("NodeUnhealthy", {"node_id": "n1"}), 6),
        record(topics.NODE_RECOVERED, raw("NodeRecovered", {"node_id": 7, "cluster": []}), 7),
        record(topics.CLUSTER_CAPACITY, raw("ClusterCapacity", capacity("ok", node("e"))), 8),
    ]
    writes = fleet_writes(batch)
    assert list(writes.inventories) == ["ok"]  # a refused inventory changes nothing
    assert writes.verdicts == []
    letters = [
        (d.key, d.envelope.payload["offset"], d.envelope.payload["error"]) for d in writes.dead
    ]
    assert all(d.topic == topics.DEAD_LETTER for d in writes.dead)
    # The unreadable health records; the unreadable cluster.capacity records (offsets 0 to 4:
    # a node of 10**9 or -8 accelerators is refused by NodeInfo itself) are pools.record_pools'
    # to dead-letter.
    assert sorted((offset, topic) for topic, offset, _ in letters) == [
        (5, topics.NODE_UNHEALTHY),
        (6, topics.NODE_UNHEALTHY),
        (7, topics.NODE_RECOVERED),
    ]
