"""The queue's budget check, the gateway's usage query helpers and `qm usage`'s table."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from fastapi import HTTPException
from rich.console import Console

from cli.usage import efficiency_table, usage_table
from schemas.usage import BudgetExceeded, BudgetUnit, Enforcement
from services.gateway.auth import Principal, Role
from services.gateway.usage import as_csv, parse_group_by, scope_tenant, usage_sql, window
from services.queue.budgets import BUDGET_EXHAUSTED, check_budget, note_exceeded

MARCH = datetime(2026, 3, 14, tzinfo=UTC)


def announced(**fields: object) -> BudgetExceeded:
    base: dict[str, object] = {
        "budget_id": "research-monthly",
        "tenant": "research",
        "month": "2026-03",
        "unit": BudgetUnit.ACCELERATOR_HOURS,
        "limit": 2000,
        "used": 2013.4,
        "threshold_pct": 100,
        "enforcement": Enforcement.BLOCK,
        "crossed_at": MARCH,
        "message": "used up",
    }
    return BudgetExceeded.model_validate({**base, **fields})


def test_a_used_up_blocking_budget_refuses_new_jobs_with_the_numbers() -> None:
    blocks = note_exceeded({}, announced())
    refusal = check_budget("research", "any", blocks, MARCH)
    assert refusal is not None and refusal.reason_code == BUDGET_EXHAUSTED
    assert (refusal.used, refusal.limit, refusal.month) == (2013.4, 2000, "2026-03")
    assert "used 2,013.4 of its 2,000.0 accelerator-hour budget" in refusal.message
    assert "2026-04-01" in refusal.message
    assert check_budget("vision", "any", blocks, MARCH) is None
    assert check_budget("research", "any", blocks, datetime(2026, 4, 1, tzinfo=UTC)) is None


def test_only_block_at_100_percent_blocks_and_a_project_budget_covers_its_project() -> None:
    assert note_exceeded({}, announced(threshold_pct=80)) == {}
    assert note_exceeded({}, announced(enforcement=Enforcement.NOTIFY)) == {}
    blocks = note_exceeded(
        {},
        announced(
            project="asr", unit=BudgetUnit.CURRENCY, currency="USD", limit=20000, used=20001.5
        ),
    )
    assert check_budget("research", "tts", blocks, MARCH) is None
    refusal = check_budget("research", "asr", blocks, MARCH)
    assert refusal is not None and "20,001.50 of its 20,000.00 USD budget" in refusal.message


def test_a_block_for_an_older_month_does_not_replace_a_newer_one() -> None:
    blocks = note_exceeded({}, announced(month="2026-03"))
    assert note_exceeded(blocks, announced(month="2026-02")) == blocks
    december = note_exceeded({}, announced(month="2026-12"))
    refusal = check_budget("research", "x", december, datetime(2026, 12, 5, tzinfo=UTC))
    assert refusal is not None and "2027-01-01" in refusal.message


def test_group_by_is_a_whitelist() -> None:
    assert parse_group_by("tenant, project,tenant") == ["tenant", "project"]
    with pytest.raises(HTTPException) as exc:
        parse_group_by("tenant;drop table")
    assert exc.value.status_code == 422


def test_tenants_see_their_own_usage_and_finance_sees_all() -> None:
    user = Principal("vision", Role.USER)
    assert scope_tenant(user, None) == "vision"
    with pytest.raises(HTTPException) as exc:
        scope_tenant(user, "nlp")
    assert exc.value.status_code == 403
    assert scope_tenant(Principal("platform", Role.FINANCE), None) is None
    assert scope_tenant(Principal("platform", Role.ADMIN), "nlp") == "nlp"
    assert scope_tenant(Principal("platform", Role.OPS), None) == "platform"


def test_the_usage_query_and_its_window() -> None:
    sql = usage_sql(["user", "day"], "vision", "usage")
    assert '"user" AS user' in sql and "tenant = $3" in sql and "kind <> 'idle'" in sql
    with pytest.raises(HTTPException):
        usage_sql(["tenant"], None, "everything")
    start, end = window(None, None, MARCH)
    assert start == datetime(2026, 3, 1, tzinfo=UTC) and end == MARCH
    with pytest.raises(HTTPException):
        window(MARCH, MARCH, MARCH)


def test_csv_has_a_header_and_one_line_per_group() -> None:
    rows = [{"tenant": "vision", "cost": 1.5, "extra": 1}, {"tenant": "nlp", "cost": None}]
    assert as_csv(rows, ["tenant", "cost"]) == "tenant,cost\nvision,1.5\nnlp,\n"


def test_qm_usage_tables() -> None:
    report = {
        "from": "2026-03-01T00:00:00Z",
        "to": "2026-03-14T00:00:00Z",
        "group_by": ["tenant", "project"],
        "rows": [
            {
                "tenant": "vision",
                "project": "detect",
                "accelerator_hours": 12.5,
                "cost": 26.25,
                "runs": 3,
                "currency": "USD",
            },
        ],
        "total": {"currency": "USD", "accelerator_hours": 12.5, "cost": 26.25},
    }
    console = Console(record=True, width=120)
    console.print(usage_table(report))
    text = console.export_text()
    assert "vision" in text and "12.500" in text and "26.25" in text and "cost USD" in text
    fleet = {
        "rows": [
            {
                "cluster": "onprem-h100",
                "accelerator_type": "H100",
                "allocated_accelerator_seconds": 7200.0,
                "idle_accelerator_seconds": 2400.0,
                "efficiency": 0.75,
                "idle_cost": 1.4,
            }
        ]
    }
    console.print(efficiency_table(fleet))
    assert "75.0%" in console.export_text()
