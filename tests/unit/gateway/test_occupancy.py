"""Who holds which device: device and node states, totals by type and the gang shapes that fit
now, from the inventories' nodes and the placements of jobs holding devices."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemas.job import JobState
from services.gateway.occupancy import (
    DeviceState,
    Holder,
    NodeState,
    NodeUse,
    fragmentation,
    occupy,
    totals,
    visible_jobs,
)
from tests.unit.gateway.builders import gpu_nodes, job_on


def states(use: NodeUse) -> str:
    marks = {
        DeviceState.IDLE: ".",
        DeviceState.ALLOCATED: "A",
        DeviceState.HELD: "H",
        DeviceState.QUARANTINED: "Q",
        DeviceState.CORDONED: "C",
    }
    return "".join(marks[d.state] for d in use.devices)


@pytest.mark.parametrize(
    ("holders", "expected", "node_state"),
    [
        ([], "........", NodeState.IDLE),
        ([job_on("j1", ("c1-h100-0", 4, (0, 1, 2, 3)))], "AAAA....", NodeState.PARTIAL),
        (
            [job_on("j1", ("c1-h100-0", 4, (4, 5, 6, 7)), state=JobState.PLACED)],
            "....HHHH",
            NodeState.PARTIAL,
        ),
        (
            [
                job_on("j1", ("c1-h100-0", 4, (0, 1, 2, 3))),
                job_on("j2", ("c1-h100-0", 4, (4, 5, 6, 7)), state=JobState.PREEMPTING),
            ],
            "AAAAAAAA",
            NodeState.ALLOCATED,
        ),
        # Replicas that name no devices go on the lowest free ones, after the named ones.
        (
            [
                job_on("j1", ("c1-h100-0", 2, (0, 2))),
                job_on("j2", ("c1-h100-0", 3, ())),
            ],
            "AAAAA...",
            NodeState.PARTIAL,
        ),
        # An index past the node's end, or a node of another cluster, shows nothing.
        ([job_on("j1", ("c1-h100-0", 1, (9,)))], "........", NodeState.IDLE),
        ([job_on("j1", ("c1-h100-0", 1, (0,)), cluster="c2")], "........", NodeState.IDLE),
    ],
)
def test_device_states(holders: list[Holder], expected: str, node_state: NodeState) -> None:
    (use,) = occupy(gpu_nodes(1), holders)
    assert states(use) == expected
    assert use.state is node_state


def test_a_device_shared_by_fractions_is_allocated_and_counts_its_share() -> None:
    halves = [job_on(f"j{i}", ("c1-h100-0", 0.5, (2,))) for i in range(2)]
    quarter = job_on("j9", ("c1-h100-0", 0.25, (5,)))
    (use,) = occupy(gpu_nodes(1), [*halves, quarter])
    assert (use.devices[2].used, use.devices[5].used) == (1.0, 0.25)
    assert [h.job_id for h in use.devices[2].holders] == ["j0", "j1"]
    assert states(use) == "..A..A.."


def test_an_unnamed_fraction_shares_the_first_device_with_room() -> None:
    first = job_on("j1", ("c1-h100-0", 0.75, (0,)))
    unnamed = job_on("j2", ("c1-h100-0", 0.5, ()))
    (use,) = occupy(gpu_nodes(1), [first, unnamed])
    assert use.approximate
    assert [round(d.used, 2) for d in use.devices[:2]] == [0.75, 0.5]


def test_broken_nodes_are_quarantined_or_cordoned_whatever_runs_there() -> None:
    sick = gpu_nodes(1, quarantined=True, cause="xid_79")[0]
    cordoned = replace(gpu_nodes(2)[1], schedulable=False)
    running = job_on("j1", (sick.node_id, 8, tuple(range(8))))
    sick_use, cordoned_use = occupy([sick, cordoned], [running])
    assert states(sick_use) == "Q" * 8 and sick_use.state is NodeState.QUARANTINED
    assert sick_use.devices[0].holders  # the job is still named on the node's page
    assert states(cordoned_use) == "C" * 8 and cordoned_use.state is NodeState.CORDONED


def test_totals_add_up_by_type() -> None:
    nodes = [
        *gpu_nodes(3),
        *gpu_nodes(2, gpus=4, type="TPU-v5e", cluster="c2"),
    ]
    nodes[1] = replace(nodes[1], quarantined=True)
    nodes[3] = replace(nodes[3], schedulable=False)
    holders = [
        job_on("j1", ("c1-h100-0", 2, (0, 1))),
        job_on("j2", ("c1-h100-2", 1, (7,)), state=JobState.PLACED),
        job_on("j3", ("c2-tpu-v5e-1", 0.5, (3,)), cluster="c2", type="TPU-v5e"),
    ]
    by_type = {t.accelerator_type: t for t in totals(occupy(nodes, holders))}
    h100, tpu = by_type["H100"], by_type["TPU-v5e"]
    assert (h100.total, h100.allocated, h100.held, h100.idle) == (24, 3, 1, 13)
    assert (h100.quarantined, h100.cordoned, h100.unhealthy, h100.in_use) == (8, 0, 8, 3.0)
    assert (tpu.total, tpu.allocated, tpu.idle, tpu.cordoned, tpu.in_use) == (8, 1, 3, 4, 0.5)
    for t in (h100, tpu):
        assert t.allocated + t.idle + t.unhealthy == t.total


def test_fragmentation_counts_whole_idle_devices_of_healthy_nodes() -> None:
    nodes = [
        *gpu_nodes(4),
        *gpu_nodes(1, gpus=4, type="TPU-v5e", cluster="c2"),
    ]
    nodes[2] = replace(nodes[2], quarantined=True)
    nodes[3] = replace(nodes[3], schedulable=False)
    holders = [
        job_on("half", ("c1-h100-0", 4, (0, 2, 4, 6))),  # leaves 4 idle devices, not adjacent
        job_on("sliver", ("c1-h100-1", 0.1, (0,))),  # a fraction takes a whole device from gangs
    ]
    fits = {(f.accelerator_type, f.devices): f for f in fragmentation(occupy(nodes, holders))}
    assert {k: v.fits for k, v in fits.items()} == {
        ("H100", 1): 11,
        ("H100", 2): 5,
        ("H100", 4): 2,
        ("H100", 8): 0,
        ("TPU-v5e", 1): 4,
        ("TPU-v5e", 2): 2,
        ("TPU-v5e", 4): 1,  # no 8-device shape: no TPU node is that big
    }
    assert fits[("H100", 4)].nodes == 2 and fits[("H100", 4)].by_cluster == {"c1": 2}


def test_other_tenants_jobs_are_anonymous() -> None:
    mine = job_on("mine", ("c1-h100-0", 1, (0,)))
    theirs = job_on("theirs", ("c1-h100-0", 0.5, (0,)), tenant="nlp")
    (use,) = occupy(gpu_nodes(1), [mine, theirs])
    device = use.devices[0]
    assert visible_jobs(device, lambda t: t == "vision") == ["mine"]
    assert visible_jobs(device, lambda _t: True) == ["mine", "theirs"]
    assert device.state is DeviceState.ALLOCATED
