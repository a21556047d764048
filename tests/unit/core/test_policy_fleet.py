"""Parsing the shared policy file and the fleet document."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from core.errors import FleetError, PolicyError
from core.fleet import MAX_NODE_DEVICES, load_fleet
from core.policy import MAX_PRICE, BackfillMode, OrderingMode, Policy
from schemas.bounds import MAX_NODE_DEVICES as WIRE_MAX_NODE_DEVICES
from schemas.bounds import MAX_PRICE as WIRE_MAX_PRICE

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_example_policy_exposes_what_the_queue_validates() -> None:
    policy = Policy.from_dict(yaml.safe_load((EXAMPLES / "policy.yaml").read_text()))
    assert set(policy.tenants) >= {"vision", "nlp", "speech", "research", "platform"}
    for tenant in policy.tenants.values():
        assert {"default", "batch", "interactive"} <= set(tenant.queues)
        assert tenant.max_replicas > 0 and tenant.max_accelerators > 0
    assert set(policy.accelerator_types) >= {"H100", "A100", "L4", "TPU-v5e"}
    assert policy.priority_classes["high"].preempting
    assert policy.tenants["research"].nominal("L4") == 16  # the "*" quota applies to any type
    assert policy.tenants["vision"].nominal("TPU-v5e") == 0  # listed quotas exclude others


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ({"tenants": {"a": {"quota": {"H100": 1}}}}, "tenants.a: unknown key"),
        ({"tenants": {"a": {"quotas": {"H100": "lots"}}}}, "tenants.a.quotas.H100"),
        ({"tenants": {"a": {"weight": 0}}}, "tenants.a.weight"),
        ({"ordering": "random"}, "ordering"),
        ({"backfill": {"mode": "sometimes"}}, "backfill.mode"),
        ({"priority_classes": [{"name": "x"}]}, "priority_classes[0].rank"),
        ({"default_priority_class": "nope"}, "default_priority_class"),
        ({"shedule": {}}, "unknown section"),
        ({"las": {"thresholds": [10, 5]}}, "las.thresholds"),
        # A NaN would make a guard that never fires; it is refused by name, as is any number
        # a preemption knob cannot hold.
        ({"preemption": {"min_runtime_s": float("nan")}}, "preemption.min_runtime_s"),
        ({"preemption": {"repack_after_s": float("inf")}}, "preemption.repack_after_s"),
        ({"preemption": {"grace_cap_s": -1}}, "preemption.grace_cap_s"),
        ({"preemption": {"max_victims": float("nan")}}, "preemption.max_victims"),
        ({"preemption": {"repack": "yes"}}, "preemption.repack"),
        ({"preemption": {"enabled": 1}}, "preemption.enabled"),
        # A NaN or negative weight would turn a score into nonsense or a preference around.
        ({"placement": {"cost_weight": float("nan")}}, "placement.cost_weight"),
        ({"placement": {"type_demand_weight": -1}}, "placement.type_demand_weight"),
        ({"placement": {"fit_weight": "high"}}, "placement.fit_weight"),
        ({"placement": {"spot_for_preemptible_only": 0}}, "placement.spot_for_preemptible_only"),
        ({"fair_share": {"usage_weight": float("inf")}}, "fair_share.usage_weight"),
        ({"backfill": {"min_reserved_accelerators": -8}}, "backfill.min_reserved_accelerators"),
        ({"backfill": {"max_reservations": True}}, "backfill.max_reservations"),
        # A negative price would credit whoever ran there; a huge or NaN one breaks the bill.
        ({"prices": {"H100": {"spot": -0.5}}}, "prices.H100.spot"),
        ({"prices": {"H100": {"on_demand": float("nan")}}}, "prices.H100.on_demand"),
        ({"prices": {"H100": {"reserved": 1e300}}}, "prices.H100.reserved"),
    ],
)
def test_bad_policy_names_the_key(doc: dict[str, object], fragment: str) -> None:
    with pytest.raises(PolicyError, match=None) as error:
        Policy.from_dict(doc)
    assert fragment in str(error.value)


def test_policy_sections_parse() -> None:
    policy = Policy.from_dict(
        {"ordering": "las", "backfill": {"mode": "greedy", "max_reservations": 3}}
    )
    assert policy.ordering is OrderingMode.LAS
    assert policy.backfill.mode is BackfillMode.GREEDY
    assert policy.backfill.max_reservations == 3
    assert Policy.default().rank("unknown-class") == Policy.default().rank("normal")


def test_fleet_generates_named_nodes_with_topology() -> None:
    doc = {
        "clusters": [
            {
                "name": "east",
                "kind": "cloud",
                "prices": {"H100": {"spot": 1.5}},
                "node_groups": [
                    {
                        "prefix": "h",
                        "count": 10,
                        "accelerator_type": "H100",
                        "nodes_per_rack": 4,
                        "racks_per_block": 2,
                        "nvlink_domain_size": 2,
                        "price_tier": "spot",
                    },
                ],
            }
        ]
    }
    clusters, nodes = load_fleet(doc)
    assert list(clusters) == ["east"]
    assert sorted(nodes)[0] == "east-h-0000" and len(nodes) == 10
    last = nodes["east-h-0009"]  # type: ignore[index]
    assert (last.rack, last.block, last.nvlink_domain) == ("h-r2", "h-b1", "h-nv4")
    assert clusters["east"].prices[("H100", last.price_tier)] == 1.5  # type: ignore[index]


def test_example_fleet_loads() -> None:
    policy = Policy.from_dict(yaml.safe_load((EXAMPLES / "policy.yaml").read_text()))
    clusters, nodes = load_fleet(
        yaml.safe_load((EXAMPLES / "fleet.yaml").read_text()), policy.accelerator_types
    )
    assert len(clusters) == 3 and len(nodes) > 0
    assert {n.accelerator.type for n in nodes.values()} <= set(policy.accelerator_types)


def group(**over: object) -> dict[str, object]:
    return {"count": 2, "accelerator_type": "H100", **over}


@pytest.mark.parametrize(
    "doc",
    [
        {},
        {"clusters": [{"name": "a", "node_groups": [{"count": 1}]}]},
        {"clusters": [{"name": "a", "node_groups": [{"count": -1, "accelerator_type": "X"}]}]},
        {"clusters": [{"name": "a", "kind": "moon"}]},
        {"clusters": [{"name": "a"}, {"name": "a"}]},
        {"clusters": [{"name": "a", "prices": {"H100": {"spot": -1}}}]},
        # A NaN or negative size would reach the executor's inventory (which the wire
        # refuses) and a huge count would be built in memory by every service.
        {"clusters": [{"name": "a", "node_groups": [group(cpu=float("nan"))]}]},
        {"clusters": [{"name": "a", "node_groups": [group(relative_speed=-1)]}]},
        {"clusters": [{"name": "a", "node_groups": [group(memory_gb=float("inf"))]}]},
        {"clusters": [{"name": "a", "node_groups": [group(count=10**9)]}]},
        {"clusters": [{"name": "a", "node_groups": [group(accelerators_per_node=5000)]}]},
        {"clusters": [{"name": "a", "prices": {"H100": {"spot": float("inf")}}}]},
        {"clusters": [{"name": "a", "prices": {"H100": {"spot": MAX_PRICE * 2}}}]},
    ],
)
def test_bad_fleet_raises(doc: dict[str, object]) -> None:
    assert load_fleet({"clusters": [{"name": "a", "node_groups": [group()]}]})  # the base is fine
    with pytest.raises(FleetError):
        load_fleet(doc)


def test_the_files_and_the_wire_hold_prices_and_devices_to_one_bound() -> None:
    assert MAX_PRICE == WIRE_MAX_PRICE
    assert MAX_NODE_DEVICES == WIRE_MAX_NODE_DEVICES
    clusters, _ = load_fleet(
        {"clusters": [{"name": "a", "prices": {"H100": {"spot": 0, "on_demand": MAX_PRICE}}}]}
    )
    assert set(clusters["a"].prices.values()) == {0.0, MAX_PRICE}  # type: ignore[index]
    with pytest.raises(FleetError, match=r"clusters\[0\]\.prices\.H100\.spot: expected a price"):
        load_fleet({"clusters": [{"name": "a", "prices": {"H100": {"spot": "cheap"}}}]})
