"""Budget enforcement at submission. The queue remembers the budgets the meter announced as
used up (`budget.exceeded` at 100% with enforcement `block`) and refuses new jobs they cover,
with reason `budget_exhausted` and the numbers. Pure: the caller keeps the state and the clock.

A block lasts for the calendar month (UTC) it was announced for; next month's submissions
pass until the meter announces that month's budget as used up again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from schemas.usage import BudgetExceeded, BudgetUnit, Enforcement, budget_month

BUDGET_EXHAUSTED = "budget_exhausted"


@dataclass(frozen=True)
class BudgetBlock:
    """A budget used up in `month`: what the queue keeps per budget id."""

    budget_id: str
    tenant: str
    project: str | None  # None: every project of the tenant
    month: str
    unit: BudgetUnit
    limit: float
    used: float
    currency: str | None = None

    def covers(self, tenant: str, project: str, month: str) -> bool:
        return self.month == month and self.tenant == tenant and self.project in (None, project)


@dataclass(frozen=True)
class BudgetRejection:
    reason_code: str  # always BUDGET_EXHAUSTED
    message: str
    budget_id: str
    month: str
    unit: BudgetUnit
    limit: float
    used: float


def block_from(event: BudgetExceeded) -> BudgetBlock | None:
    """The block an announcement imposes, or None when it only informs."""
    if event.enforcement is not Enforcement.BLOCK or event.threshold_pct < 100:
        return None
    return BudgetBlock(
        event.budget_id,
        event.tenant,
        event.project,
        event.month,
        event.unit,
        event.limit,
        event.used,
        event.currency,
    )


def note_exceeded(
    blocks: Mapping[str, BudgetBlock], event: BudgetExceeded
) -> dict[str, BudgetBlock]:
    """The blocks after this announcement (a new dict; the newest month per budget wins)."""
    block = block_from(event)
    current = blocks.get(event.budget_id)
    if block is None or (current is not None and current.month >= block.month):
        return dict(blocks)
    return {**blocks, block.budget_id: block}


def _number(unit: BudgetUnit, value: float) -> str:
    return f"{value:,.1f}" if unit is BudgetUnit.ACCELERATOR_HOURS else f"{value:,.2f}"


def _unit(unit: BudgetUnit, currency: str | None) -> str:
    return "accelerator-hour" if unit is BudgetUnit.ACCELERATOR_HOURS else (currency or "currency")


def _next_month(month: str) -> str:
    year, mon = map(int, month.split("-"))
    return f"{year + mon // 12:04d}-{mon % 12 + 1:02d}-01"


def check_budget(
    tenant: str, project: str, blocks: Mapping[str, BudgetBlock], now: datetime
) -> BudgetRejection | None:
    """Why a new job of this tenant and project must be refused for budget, or None."""
    month = budget_month(now)
    for block in sorted(blocks.values(), key=lambda b: b.budget_id):
        if not block.covers(tenant, project, month):
            continue
        scope = f"tenant {tenant!r}" + (f" project {block.project!r}" if block.project else "")
        message = (
            f"{scope} has used {_number(block.unit, block.used)} of its "
            f"{_number(block.unit, block.limit)} {_unit(block.unit, block.currency)} budget "
            f"for {month} "
            f"(budget {block.budget_id}); new jobs are refused until "
            f"{_next_month(month)} UTC or until finance raises the budget"
        )
        return BudgetRejection(
            BUDGET_EXHAUSTED, message, block.budget_id, month, block.unit, block.limit, block.used
        )
    return None
