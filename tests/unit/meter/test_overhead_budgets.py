"""Idle capacity (showback and chargeback) and budgets: configuration, thresholds, messages."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.health import Severity
from schemas.usage import BudgetUnit, Enforcement, TickKind, budget_month
from services.meter.budgets import (
    Budget,
    ConfigError,
    alert_for,
    exceeded,
    parse_config,
    reached,
    usage_deltas,
    used,
)
from services.meter.overhead import OverheadMode, OverheadPolicy, idle_ticks, split
from services.meter.pricing import Pool
from services.meter.ticks import MICRO as S
from services.meter.ticks import close_run
from tests.unit.meter.builders import T0, grid, run

RESERVED = Pool("onprem-h100", "H100", "reserved", 16, 2_100_000)
SPOT = Pool("cloud-a100", "A100", "spot", 8, 1_100_000)
K = 29_000_000  # any interval


def test_showback_reports_idle_capacity_as_platform_overhead() -> None:
    allocated = {RESERVED.key: {"vision": 300 * S, "nlp": 180 * S}}
    ticks = idle_ticks(K, [RESERVED, SPOT], allocated, grid(60), OverheadPolicy())
    assert [(t.cluster, t.tenant, t.accelerator_seconds_u, t.cost_u) for t in ticks] == [
        ("cloud-a100", "platform", 480 * S, 0),  # spot idle costs nothing
        ("onprem-h100", "platform", 480 * S, 280_000),  # 16 x 60 - 480, at 2.10 an hour
    ]
    assert all(t.kind is TickKind.IDLE and t.seconds_u == 60 * S for t in ticks)
    assert ticks[1].count_u == 8 * S  # eight accelerators idle on average


def test_chargeback_spreads_idle_reserved_capacity_by_usage_share() -> None:
    allocated = {RESERVED.key: {"vision": 300 * S, "nlp": 100 * S}}
    policy = OverheadPolicy(OverheadMode.CHARGEBACK)
    ticks = idle_ticks(K, [RESERVED], allocated, grid(60), policy)
    assert {t.tenant: t.accelerator_seconds_u for t in ticks} == {"vision": 420 * S, "nlp": 140 * S}
    # Usage plus its share of the idle: together they pay for the whole pool.
    assert sum(t.accelerator_seconds_u for t in ticks) + 400 * S == 16 * 60 * S


def test_a_full_pool_has_no_idle_tick() -> None:
    allocated = {SPOT.key: {"vision": 480 * S}}
    assert idle_ticks(K, [SPOT], allocated, grid(60), OverheadPolicy()) == []


@given(
    amount=st.integers(0, 10**12),
    weights=st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 10**9), min_size=1),
)
def test_a_split_adds_up_exactly(amount: int, weights: dict[str, int]) -> None:
    parts = split(amount, weights)
    assert set(parts) == set(weights)
    assert sum(parts.values()) == amount
    assert all(
        abs(parts[n] * sum(weights.values()) - amount * w) <= sum(weights.values()) * 6
        for n, w in weights.items()
    )


def budget(**fields: object) -> Budget:
    base: dict[str, object] = {
        "budget_id": "b",
        "tenant": "vision",
        "project": None,
        "unit": BudgetUnit.ACCELERATOR_HOURS,
        "limit": Decimal(10),
    }
    return Budget(**{**base, **fields})  # type: ignore[arg-type]


def test_usage_counts_per_project_and_month_and_never_idle() -> None:
    g = grid(60)
    ticks = close_run(run(start=T0, g=g), 3600 * S, g, "succeeded")
    idle = idle_ticks(K, [RESERVED], {}, g, OverheadPolicy())
    deltas = usage_deltas(ticks + idle)
    assert deltas == {("vision", "detect", "2026-03"): (28800 * S, 16_800_000)}


def test_budgets_measure_in_their_own_unit_and_scope() -> None:
    totals = {
        ("vision", "detect"): (7200 * S, 10_500_000),
        ("vision", "seg"): (21600 * S, 30 * S),
        ("nlp", "llm"): (99999 * S, 999 * S),
    }
    assert used(budget(), totals) == 8  # hours over all of vision's projects
    assert used(budget(project="detect"), totals) == 2
    assert used(budget(unit=BudgetUnit.CURRENCY), totals) == Decimal("40.5")
    assert reached(budget(), Decimal(8)) == [50, 80]
    assert reached(budget(), Decimal("4.99")) == []
    assert reached(budget(), Decimal(10)) == [50, 80, 100]


def test_the_exceeded_event_and_alert_say_what_happened_and_what_follows() -> None:
    b = budget(enforcement=Enforcement.BLOCK, project="detect")
    event = exceeded(b, "2026-03", Decimal("10.25"), Decimal(100), "USD", T0)
    assert event.threshold_pct == 100 and event.used == 10.25 and event.limit == 10
    assert "project 'detect'" in event.message and "rejected" in event.message
    alert = alert_for(event, "meter")
    assert alert.severity is Severity.CRITICAL
    assert alert.alert_id == "budget/b/2026-03/100" and alert.subject == "budget/b"
    assert "qm usage --tenant vision" in alert.suggested_action
    early = exceeded(b, "2026-03", Decimal(5), Decimal(50), "USD", T0)
    assert "rejected" not in early.message
    assert alert_for(early, "meter").severity is Severity.INFO
    slow = exceeded(
        budget(enforcement=Enforcement.DEPRIORITIZE),
        "2026-03",
        Decimal(11),
        Decimal(100),
        "USD",
        T0,
    )
    assert slow.weight_factor == 0.5


def test_the_example_budgets_file_parses() -> None:
    from pathlib import Path

    from services.common.policyfile import read_yaml

    config = parse_config(read_yaml(Path(__file__).parents[3] / "examples" / "budgets.yaml"))
    assert config.overhead.mode is OverheadMode.SHOWBACK
    assert {b.enforcement for b in config.budgets} == set(Enforcement)
    assert budget_month(T0) == "2026-03"


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"budgets": [{"tenant": "a", "limit": {"hours": 3}}]}, "hours"),
        ({"budgets": [{"tenant": "a", "limit": {"currency": -1}}]}, "positive"),
        ({"budgets": [{"tenant": "a", "limit": {"currency": float("nan")}}]}, "limit.currency"),
        # A weight factor only lowers a weight: the wire refuses any other (BudgetExceeded).
        (
            {"budgets": [{"tenant": "a", "limit": {"currency": 9}, "deprioritize_weight": 2}]},
            "at most 1",
        ),
        ({"budgets": [{"limit": {"currency": 1}}]}, "tenant"),
        ({"budgets": [{"tenant": "a", "limit": {"currency": 1}, "enforce": "block"}]}, "enforce"),
        ({"overhead": {"mode": "sometimes"}}, "overhead.mode"),
        ({"budgets": [{"tenant": "a", "limit": {"currency": 1}}] * 2}, "duplicate"),
    ],
)
def test_a_wrong_budgets_file_names_the_key(doc: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_config(doc)
