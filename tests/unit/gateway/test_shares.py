"""A tenant's standing: borrowed above nominal quota, lent out of unused quota in proportion to
what each cohort member can lend, and fair share by weight among tenants with demand."""

from __future__ import annotations

import pytest

from core.policy import Policy
from services.gateway.shares import Load, lent, nominal, standings

POLICY = Policy.from_dict(
    {
        "tenants": {
            "vision": {"weight": 1.0, "cohort": "research", "quotas": {"H100": 128, "A100": 64}},
            "nlp": {
                "weight": 1.5,
                "cohort": "research",
                "quotas": {"H100": 256},
                "lend_limit": {"H100": 128},
            },
            "research": {"weight": 0.5, "cohort": "research", "quotas": {"*": 16}},
            "platform": {"weight": 2.0, "quotas": {"A100": 16}},
            "free": {},
        }
    }
)


def loads(**usage: dict[str, float]) -> dict[str, Load]:
    return {tenant: Load(usage=dict(held)) for tenant, held in usage.items()}


def test_borrowing_is_put_down_to_the_lenders_by_what_each_can_lend() -> None:
    # vision borrows 32 H100; nlp could lend 128 (its limit), research 16 (all its unused quota).
    now = loads(vision={"H100": 160}, nlp={"H100": 56})
    by = {s.tenant: {t.accelerator_type: t for t in s.types} for s in standings(POLICY, now)}
    assert by["vision"]["H100"].borrowed == 32 and by["vision"]["H100"].lent == 0
    assert by["nlp"]["H100"].lent == pytest.approx(32 * 128 / 144)
    assert by["research"]["H100"].lent == pytest.approx(32 * 16 / 144)
    total_lent = sum(lent(POLICY, now, t, "H100") for t in ("vision", "nlp", "research"))
    assert total_lent == pytest.approx(32)


def test_lending_is_capped_by_what_the_cohort_can_lend() -> None:
    # 300 borrowed but only 144 lendable (a policy changed under running work): 144 is lent.
    now = loads(vision={"H100": 428}, nlp={"H100": 56})
    assert lent(POLICY, now, "nlp", "H100") + lent(POLICY, now, "research", "H100") == (
        pytest.approx(144)
    )


def test_without_a_cohort_nothing_is_lent() -> None:
    now = loads(platform={"A100": 0}, vision={"A100": 80})
    assert lent(POLICY, now, "platform", "A100") == 0


def test_fair_share_is_the_weight_share_among_tenants_with_demand() -> None:
    now = {"vision": Load(usage={"H100": 30}), "nlp": Load(pending={"H100": 8})}
    now["nlp"].usage["A100"] = 10
    by = {s.tenant: s for s in standings(POLICY, now)}
    assert by["vision"].fair_share == pytest.approx(1.0 / 2.5)
    assert by["nlp"].fair_share == pytest.approx(1.5 / 2.5)
    assert by["research"].fair_share is None and by["platform"].fair_share is None
    assert by["vision"].actual_share == pytest.approx(0.75)
    assert by["nlp"].actual_share == pytest.approx(0.25)
    assert by["research"].actual_share == 0


def test_a_scoped_standing_is_computed_against_everyone() -> None:
    now = loads(vision={"H100": 160}, nlp={"H100": 56})
    (only,) = standings(POLICY, now, tenants=["nlp"])
    full = {s.tenant: s for s in standings(POLICY, now)}["nlp"]
    assert only == full


@pytest.mark.parametrize(
    ("tenant", "accelerator_type", "expected"),
    [
        ("vision", "H100", 128),
        ("vision", "L4", 0),  # quotas listed, this type not: none of it
        ("research", "L4", 16),  # `*` covers every type
        ("free", "H100", None),  # no quotas: unconstrained
        ("vision", "A100|H100", None),  # a pending job accepting several types
        ("research", "any", None),
        ("stranger", "H100", None),  # not in the policy
    ],
)
def test_nominal(tenant: str, accelerator_type: str, expected: float | None) -> None:
    assert nominal(POLICY.tenant(tenant), accelerator_type) == expected


def test_types_shown_are_the_quotas_the_use_and_the_demand() -> None:
    now = {
        "vision": Load(usage={"L4": 2}, pending={"A100|H100": 16}),
        "stranger": Load(pending={"H100": 8}),
    }
    by = {s.tenant: s for s in standings(POLICY, now, fleet_types=["H100", "TPU-v5e"])}
    assert [t.accelerator_type for t in by["vision"].types] == ["A100", "A100|H100", "H100", "L4"]
    # `*` shows the fleet's types; L4 too, because vision (no L4 quota) borrows research's.
    research = {t.accelerator_type: t for t in by["research"].types}
    assert sorted(research) == ["H100", "L4", "TPU-v5e"]
    assert research["L4"].nominal == 16 and research["L4"].lent == pytest.approx(2)
    assert by["stranger"].weight == 1.0 and by["stranger"].types[0].nominal is None
    assert by["stranger"].fair_share == pytest.approx(1.0 / 2.0)
