"""Monthly budgets as the budgets file (QM_BUDGETS_FILE) declares them: the meter enforces
them, the gateway's cost page shows them. Pure parsing; docs/metering.md explains each key."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from schemas.usage import BudgetUnit, Enforcement

DEFAULT_THRESHOLDS = (Decimal(50), Decimal(80), Decimal(100))


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


def parse_budgets(raw: Any) -> tuple[Budget, ...]:
    """The `budgets:` list of a budgets file; ConfigError names the key that is wrong."""
    if not isinstance(raw, list):
        raise ConfigError("budgets: expected a list")
    budgets = tuple(_budget(b, f"budgets[{i}]") for i, b in enumerate(raw))
    ids = [b.budget_id for b in budgets]
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"budgets: duplicate id(s) {sorted({i for i in ids if ids.count(i) > 1})}"
        )
    return budgets


def keys(d: Any, allowed: set[str], where: str) -> None:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(allowed)}")


def _budget(d: Any, where: str) -> Budget:
    keys(
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
        # A multiplier that only lowers a weight (the wire refuses any other, BudgetExceeded).
        weight_factor=_positive(
            d.get("deprioritize_weight", 0.5), f"{where}.deprioritize_weight", most=1
        ),
    )


def _positive(value: Any, where: str, most: float = math.inf) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if not 0 < value <= most or (isinstance(value, float) and not math.isfinite(value)):
        bound = "" if most == math.inf else f" and at most {most:g}"
        raise ConfigError(f"{where}: must be positive and finite{bound}, got {value!r}")
    return Decimal(str(value))
