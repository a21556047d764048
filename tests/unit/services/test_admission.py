"""Admission against the policy: one reason per kind of mistake, with what to change."""

from __future__ import annotations

from typing import Any

import pytest

from schemas.events import RejectReason
from services.common.admission import check_admission
from tests.unit.services.builders import policy, spec


@pytest.mark.parametrize(
    ("fields", "reason", "fragment"),
    [
        ({"tenant": "ghosts"}, RejectReason.UNKNOWN_TENANT, "known tenants: nlp, vision"),
        ({"queue": "express"}, RejectReason.UNKNOWN_QUEUE, "its queues: default, batch"),
        ({"priority_class": "urgent"}, RejectReason.UNKNOWN_PRIORITY_CLASS, "low, normal"),
        (
            {"resources": {"accelerator_types": ["H100", "B200"]}},
            RejectReason.UNKNOWN_ACCELERATOR_TYPE,
            "B200",
        ),
        ({"replicas": 0}, RejectReason.INVALID_RESOURCES, "at least 1"),
        ({"resources": {"accelerators": -1}}, RejectReason.INVALID_RESOURCES, "greater than 0"),
        ({"replicas": 5}, RejectReason.GANG_TOO_LARGE, "limit of 4"),
        (
            {"replicas": 4, "resources": {"accelerators": 16}},
            RejectReason.TOO_MANY_ACCELERATORS,
            "at most 32",
        ),
    ],
)
def test_each_mistake_has_its_reason(
    fields: dict[str, Any], reason: RejectReason, fragment: str
) -> None:
    rejection = check_admission(spec(**fields), policy())
    assert rejection is not None
    assert rejection.reason is reason
    assert fragment in rejection.message


def test_a_good_job_is_admitted() -> None:
    good = spec(replicas=4, resources={"accelerators": 8, "accelerator_types": ["H100"]})
    assert check_admission(good, policy()) is None
