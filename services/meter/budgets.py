"""The metering configuration (QM_BUDGETS_FILE, e.g. examples/budgets.yaml) and budget
thresholds: monthly budgets per tenant or project, in accelerator-hours or currency. Pure.

A budget counts the usage ticks (not idle capacity) whose interval starts in its calendar
month (UTC). Each threshold is announced once per budget and month.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from schemas.health import AlertRaised, Severity
from schemas.usage import (
    BudgetExceeded,
    BudgetUnit,
    Enforcement,
    TickKind,
    budget_month,
)
from services.common.budgetfile import Budget, ConfigError, keys, parse_budgets
from services.meter.overhead import OverheadMode, OverheadPolicy
from services.meter.ticks import Tick, decimal

# (tenant, project) -> (accelerator-seconds, cost) in one month, in millionths
Totals = Mapping[tuple[str, str], tuple[int, int]]


@dataclass(frozen=True)
class MeterConfig:
    currency: str = "USD"
    overhead: OverheadPolicy = field(default_factory=OverheadPolicy)
    budgets: tuple[Budget, ...] = ()


def used(budget: Budget, totals: Totals) -> Decimal:
    """The budget's consumption in its own unit."""
    seconds, cost = 0, 0
    for (tenant, project), (s, c) in totals.items():
        if budget.covers(tenant, project):
            seconds += s
            cost += c
    if budget.unit is BudgetUnit.ACCELERATOR_HOURS:
        return decimal(seconds) / 3600
    return decimal(cost)


def usage_deltas(ticks: Iterable[Tick]) -> dict[tuple[str, str, str], tuple[int, int]]:
    """What new ticks add to each (tenant, project, month) counter (accelerator-seconds and
    cost, in millionths); idle capacity is not usage."""
    out: dict[tuple[str, str, str], tuple[int, int]] = {}
    for t in ticks:
        if t.kind is TickKind.IDLE:
            continue
        key = (t.tenant, t.project, budget_month(t.interval_start))
        s, c = out.get(key, (0, 0))
        out[key] = (s + t.accelerator_seconds_u, c + t.cost_u)
    return out


def reached(budget: Budget, consumption: Decimal) -> list[Decimal]:
    return [t for t in budget.thresholds if consumption * 100 >= t * budget.limit]


def of_tenants(budgets: Iterable[Budget], tenants: Iterable[str]) -> list[Budget]:
    wanted = set(tenants)
    return [b for b in budgets if b.tenant in wanted]


def _scope(b: Budget) -> str:
    return f"tenant {b.tenant!r}" + (f" project {b.project!r}" if b.project else "")


def _number(b: Budget, value: Decimal) -> str:
    return f"{value:,.1f}" if b.unit is BudgetUnit.ACCELERATOR_HOURS else f"{value:,.2f}"


def _unit(b: Budget, currency: str) -> str:
    return "accelerator-hour" if b.unit is BudgetUnit.ACCELERATOR_HOURS else currency


def exceeded(
    b: Budget, month: str, consumption: Decimal, threshold: Decimal, currency: str, at: datetime
) -> BudgetExceeded:
    then = {
        Enforcement.NOTIFY: "no action is taken",
        Enforcement.DEPRIORITIZE: f"its fair-share weight is multiplied by {b.weight_factor}",
        Enforcement.BLOCK: "new submissions are rejected until next month or a higher limit",
    }[b.enforcement]
    # Enforcement starts when the budget is used up; lower thresholds are early warnings.
    enforced = threshold >= 100
    message = (
        f"{_scope(b)} used {_number(b, consumption)} of its {_number(b, b.limit)} "
        f"{_unit(b, currency)} budget for {month} ({threshold:g}% threshold)"
        + (f"; {then}" if enforced else "")
    )
    return BudgetExceeded(
        budget_id=b.budget_id,
        tenant=b.tenant,
        project=b.project,
        month=month,
        unit=b.unit,
        limit=float(b.limit),
        used=float(round(consumption, 6)),
        threshold_pct=float(threshold),
        enforcement=b.enforcement,
        currency=currency if b.unit is BudgetUnit.CURRENCY else None,
        weight_factor=float(b.weight_factor) if b.enforcement is Enforcement.DEPRIORITIZE else None,
        crossed_at=at,
        message=message,
    )


def alert_for(event: BudgetExceeded, source: str) -> AlertRaised:
    """The operator's alert for a crossed threshold, in the shape alert.raised carries (it is
    not about a node or a cluster: `cluster` is empty)."""
    pct = event.threshold_pct
    severity = Severity.CRITICAL if pct >= 100 else Severity.WARNING if pct >= 80 else Severity.INFO
    who = f"--tenant {event.tenant}" + (" -g project" if event.project else "")
    return AlertRaised(
        alert_id=f"budget/{event.budget_id}/{event.month}/{pct:g}",
        severity=severity,
        subject=f"budget/{event.budget_id}",
        cluster="",
        cause=f"budget_{pct:g}pct",
        suggested_action=f"{event.message}. See `qm usage {who}`; to allow more, raise "
        f"budget {event.budget_id} in the budgets file ({source} reads it at start).",
        first_seen=event.crossed_at,
        count=1,
    )


# --- parsing -----------------------------------------------------------------------------


def parse_config(doc: Mapping[str, Any]) -> MeterConfig:
    keys(doc, {"currency", "overhead", "budgets"}, "budgets file")
    currency = str(doc.get("currency", "USD"))
    raw = doc.get("budgets") or []
    budgets = parse_budgets(raw)
    return MeterConfig(currency, _overhead(doc.get("overhead") or {}), budgets)


def _overhead(d: Mapping[str, Any]) -> OverheadPolicy:
    keys(d, {"mode", "tenant", "costed_tiers"}, "overhead")
    try:
        mode = OverheadMode(d.get("mode", "showback"))
    except ValueError:
        raise ConfigError(
            f"overhead.mode: {d.get('mode')!r} is not showback or chargeback"
        ) from None
    tiers = d.get("costed_tiers", ["reserved"])
    if not isinstance(tiers, list):
        raise ConfigError("overhead.costed_tiers: expected a list of tiers")
    return OverheadPolicy(mode, str(d.get("tenant", "platform")), frozenset(map(str, tiers)))


__all__ = ["Budget", "ConfigError", "MeterConfig", "parse_config"]
