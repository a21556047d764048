"""`PlacementHead`: a placement read without the rest of its job's spec, by the services that
follow placements but do not run them. It reads what `PlacementDecided` reads of the head, with
the same bounds, from the same bytes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from schemas.envelope import Envelope
from schemas.events import PlacementDecided, PlacementHead, SpecHead
from schemas.registry import parse_typed


def placement(**spec: Any) -> dict[str, Any]:
    whole = {"tenant": "vision", "project": "p1", "user": "ada", "preemptible": False} | spec
    return {
        "job_id": "j-1",
        "attempt": 2,
        "epoch": 3,
        "leader": "s-0",
        "cluster": "c1",
        "accelerator_type": "H100",
        "replicas": [
            {"replica": 0, "node_id": "n0", "accelerators": 2, "cpu": 1, "memory_gb": 4,
             "devices": [0, 1]},
        ],
        "spec": whole,
    }  # fmt: skip


def test_a_placement_read_as_a_head_holds_what_the_whole_one_holds_of_it() -> None:
    raw = placement(labels={"team": "a"}, command=["python", "train.py"])
    whole, head = PlacementDecided.model_validate(raw), PlacementHead.model_validate(raw)
    for name in ("job_id", "attempt", "epoch", "leader", "cluster", "accelerator_type"):
        assert getattr(head, name) == getattr(whole, name)
    assert head.replicas == whole.replicas
    assert head.spec == SpecHead(tenant="vision", project="p1", user="ada", preemptible=False)
    for name in SpecHead.model_fields:
        assert getattr(head.spec, name) == getattr(whole.spec, name)
    assert isinstance(whole, PlacementHead)  # code written for heads takes whole ones too


def test_the_head_fields_have_the_bounds_of_the_spec() -> None:
    for bad in ({"tenant": "no spaces"}, {"project": ""}, {"user": "x" * 64}, {"tenant": None}):
        with pytest.raises(ValidationError):
            PlacementHead.model_validate(placement(**bad))
        with pytest.raises(ValidationError):
            PlacementDecided.model_validate(placement(**bad))
    with pytest.raises(ValidationError):
        PlacementHead.model_validate(placement() | {"replicas": [{"replica": -1}]})
    # The replicas are checked in full: devices that do not match the amount are refused.
    bad_devices = placement()
    bad_devices["replicas"][0]["devices"] = [0]
    with pytest.raises(ValidationError):
        PlacementHead.model_validate(bad_devices)


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "bogus"},
        {"labels": {"not a key": "v"}},
        {"replicas": 2, "resources": {"accelerators": 0.5}},  # a gang needs whole devices
        {"checkpoint_grace_s": 7200},
    ],
)
def test_the_rest_of_the_spec_is_left_to_the_executor(bad: dict[str, Any]) -> None:
    """A record whose spec the executor refuses past the head, as it comes off the wire:
    the services that read heads follow the placement; the whole model (the executor's, the
    schedulers') refuses it, and the executor's refusal is what stops it."""
    env = Envelope(type="PlacementDecided", payload=placement(**bad))
    raw = env.model_dump_json().encode()
    head = parse_typed(raw, PlacementHead)
    assert head is not None and head.payload.spec.tenant == "vision"
    assert parse_typed(raw, PlacementDecided) is None  # the one pass gives up ...
    with pytest.raises(ValidationError):
        PlacementDecided.model_validate(env.payload)  # ... and the usual way refuses it


def test_a_record_parses_in_one_pass_as_a_head() -> None:
    env = Envelope(type="PlacementDecided", payload=placement(name="resnet"))
    raw = env.model_dump_json().encode()
    got = parse_typed(raw, PlacementHead)
    assert got is not None and isinstance(got.payload, PlacementHead)
    assert not isinstance(got.payload, PlacementDecided)
    assert got.payload.spec.user == "ada"
    assert json.loads(raw)["payload"]["spec"]["name"] == "resnet"  # in the bytes, not read
