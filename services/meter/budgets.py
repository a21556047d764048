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
from services.meter.overhead import OverheadMode, OverheadPolicy
from services.meter.ticks import Tick, decimal

DEFAULT_THRESHOLDS = (Decimal(50), Decimal(80), Decimal(100))
# (tenant, project) -> (accelerator-seconds, cost) in one month, in millionths
Totals = Mapping[tuple[str, str], tuple[int, int]]


class ConfigError(ValueError):
    """The budgets file is wrong; the message names the key."""


@dataclass(frozen=True)
class Budget:
    budget_id: str
    tenant: str
    project: str | None
    unit: BudgetUnit
    limit: Decimal
    thresholds: tuple[Decimal, ...] = DEFAULT_THRESHOLDS
    enforcement: Enforcement = Enforcement.NOTIFY
    weight_factor: Decimal = Decimal("0.5")

    def covers(self, tenant: str, project: str) -> bool:
        return tenant == self.tenant and self.project in (None, project)


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
    _keys(doc, {"currency", "overhead", "budgets"}, "budgets file")
    currency = str(doc.get("currency", "USD"))
    raw = doc.get("budgets") or []
    if not isinstance(raw, list):
        raise ConfigError("budgets: expected a list")
    budgets = tuple(_budget(b, f"budgets[{i}]") for i, b in enumerate(raw))
    ids = [b.budget_id for b in budgets]
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"budgets: duplicate id(s) {sorted({i for i in ids if ids.count(i) > 1})}"
        )
    return MeterConfig(currency, _overhead(doc.get("overhead") or {}), budgets)


def _keys(d: Any, allowed: set[str], where: str) -> None:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(allowed)}")


def _overhead(d: Mapping[str, Any]) -> OverheadPolicy:
    _keys(d, {"mode", "tenant", "costed_tiers"}, "overhead")
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


def _budget(d: Any, where: str) -> Budget:
    _keys(
        d,
        {"id", "tenant", "project", "limit", "thresholds", "enforcement", "deprioritize_weight"},
        where,
    )
    if not d.get("tenant"):
        raise ConfigError(f"{where}.tenant: required")
    limit = d.get("limit")
    if not isinstance(limit, Mapping) or len(limit) != 1:
        raise ConfigError(
            f"{where}.limit: expected one of {{accelerator_hours: N}}, {{currency: N}}"
        )
    ((unit_name, amount),) = limit.items()
    try:
        unit = BudgetUnit(unit_name)
        enforcement = Enforcement(d.get("enforcement", "notify"))
        value = _positive(amount, f"{where}.limit.{unit_name}")
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    thresholds = tuple(
        sorted(_positive(t, f"{where}.thresholds") for t in d.get("thresholds", [50, 80, 100]))
    )
    project = d.get("project")
    tenant = str(d["tenant"])
    return Budget(
        budget_id=str(d.get("id") or (f"{tenant}/{project}" if project else tenant)),
        tenant=tenant,
        project=str(project) if project else None,
        unit=unit,
        limit=value,
        thresholds=thresholds,
        enforcement=enforcement,
        weight_factor=_positive(d.get("deprioritize_weight", 0.5), f"{where}.deprioritize_weight"),
    )


def _positive(value: Any, where: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{where}: must be positive, got {value!r}")
    return Decimal(str(value))
