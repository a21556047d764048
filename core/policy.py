"""The scheduling policy: priority classes, tenants and quotas, fair share, placement and
preemption knobs — parsed from the YAML document the live services and the simulator share.

Parsing is strict about types and names (a typo in a quota must not silently mean "unlimited")
and lenient about absence (every section has a documented default).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from core.errors import PolicyError
from core.model import AcceleratorModel, PriceTier

# Quota key that applies to every accelerator type a tenant does not list explicitly.
ANY_TYPE = "*"

_E = TypeVar("_E", bound=StrEnum)


# The most a price per accelerator-hour may be; the same as schemas.bounds.MAX_PRICE.
MAX_PRICE = 100_000.0


class OrderingMode(StrEnum):
    FAIR_SHARE = "fair_share"
    FIFO = "fifo"
    # Least attained service (Tiresias-like): discretised queues by accelerator-seconds received.
    LAS = "las"


class BackfillMode(StrEnum):
    # Strict order: the first job that cannot be placed blocks everything behind it.
    OFF = "off"
    # Anything that fits may go, even if it delays a waiting big gang.
    GREEDY = "greedy"
    # Blocked gangs hold capacity; later jobs use it only if they end before the gang could start.
    RESERVE = "reserve"


@dataclass(frozen=True)
class PriorityClass:
    name: str
    rank: int
    # Whether jobs of this class may preempt jobs of strictly lower rank.
    preempting: bool = False
    # 0 ignores price (fastest, most available accelerator); 1 weighs it fully.
    cost_sensitivity: float = 1.0


@dataclass(frozen=True)
class TenantPolicy:
    name: str
    queues: tuple[str, ...] = ("default",)
    max_replicas: int = 64
    max_accelerators: float = 512.0
    weight: float = 1.0
    cohort: str | None = None
    # Nominal quota per accelerator type, in accelerators; None means the tenant is unconstrained.
    quotas: Mapping[str, float] | None = None
    # Most a tenant may run above its nominal quota (per type); absent type = unlimited.
    borrow_limit: Mapping[str, float] = field(default_factory=dict)
    # Most of its unused nominal quota a tenant lends to its cohort; absent type = all of it.
    lend_limit: Mapping[str, float] = field(default_factory=dict)

    def nominal(self, accelerator_type: str) -> float | None:
        if self.quotas is None:
            return None
        return self.quotas.get(accelerator_type, self.quotas.get(ANY_TYPE, 0.0))

    def max_borrow(self, accelerator_type: str) -> float:
        return _typed_limit(self.borrow_limit, accelerator_type)

    def max_lend(self, accelerator_type: str) -> float:
        return _typed_limit(self.lend_limit, accelerator_type)


def _typed_limit(limits: Mapping[str, float], accelerator_type: str) -> float:
    return limits.get(accelerator_type, limits.get(ANY_TYPE, float("inf")))


@dataclass(frozen=True)
class FairShare:
    # Past usage halves every half_life_s; the live meter and the simulator decay it the same way.
    half_life_s: float = 7 * 86400.0
    # How much decayed past usage counts next to current allocation in a tenant's share.
    usage_weight: float = 1.0


@dataclass(frozen=True)
class PlacementPreferences:
    cost_weight: float = 1.0
    fit_weight: float = 0.5
    availability_weight: float = 0.25
    # Keep accelerator types that type-restricted work depends on for that work: work that
    # could run elsewhere avoids them (core.placement._type_demand).
    type_demand_weight: float = 1.0
    # Spot capacity can vanish; only jobs that tolerate preemption may land there.
    spot_for_preemptible_only: bool = True


@dataclass(frozen=True)
class Backfill:
    mode: BackfillMode = BackfillMode.RESERVE
    # How many blocked gangs may hold capacity at once; more holds idle more of the fleet.
    max_reservations: int = 2
    # A job needing at least this many accelerators earns a reservation when blocked.
    min_reserved_accelerators: float = 16.0


@dataclass(frozen=True)
class Preemption:
    enabled: bool = True
    # Reclaim capacity lent to a borrowing tenant when its owner needs it back.
    reclaim: bool = True
    # Running jobs younger than this are never victims, which stops thrashing.
    min_runtime_s: float = 600.0
    # Cost of one checkpoint and restart, charged by the simulator as lost work.
    checkpoint_restart_s: float = 60.0
    max_victims: int = 64
    # The live preemptor's guards and timings (fleet seconds); the simulator ignores them.
    # A victim's checkpoint grace period is its spec's, never longer than this.
    grace_cap_s: float = 300.0
    # At most this many of one tenant's runs are preempted per window (a disruption budget).
    max_preemptions_per_tenant: int = 20
    budget_window_s: float = 3600.0
    # A preempted job waits this long before it may be placed again, doubling per
    # preemption up to the cap, so room made for a claim is not taken straight back.
    requeue_backoff_s: float = 30.0
    requeue_backoff_cap_s: float = 900.0
    # Move a few small running jobs (each to room that is free elsewhere) so that a job that
    # has waited this long for more of one node than any has free can start (core/repack.py).
    repack: bool = False
    repack_after_s: float = 1800.0


@dataclass(frozen=True)
class Las:
    # Boundaries of the attained-service queues, in accelerator-seconds, ascending.
    thresholds: tuple[float, ...] = (3600.0 * 8, 3600.0 * 8 * 10)


class LevelMode(StrEnum):
    # One service level per priority class: order is the ordering mode's alone.
    OFF = "off"
    # Levels by the service a job is expected to need before it ends, learned from the jobs of
    # its kind that finished before it (core/service.py); no declared durations.
    LEARNED = "learned"


@dataclass(frozen=True)
class ServiceLevels:
    """Service levels inside a priority class: jobs expected to finish with less service go
    first, and (with preemption on) may take the place of running jobs expected to need much
    more. `ordering: las` keeps its own levels (attained service against `las.thresholds`)."""

    mode: LevelMode = LevelMode.OFF
    # Accelerator-seconds of expected service per completion that still count as level 0;
    # each level above spans `ratio` times more.
    base_s: float = 1800.0
    ratio: float = 4.0
    levels: int = 8
    # Finished jobs a kind (tenant and size) needs before its own history is used instead of
    # its tenant's (then everyone's). The last 256 of each kind are remembered.
    min_samples: int = 16
    # What has finished is learned from at most this often (fleet seconds): pending jobs are
    # re-levelled then, not after every end.
    refresh_s: float = 3600.0
    # How many levels above the waiting job a running job of its rank must be to yield to it
    # for service (`ordering: las` uses 1). With 1, jobs of one kind that outlive their kind's
    # history preempt each other in turn as they cross a level's edge, each paying a
    # checkpoint and a restart; 2 asks that the victim be expected to need `ratio` times more.
    preempt_gap: int = 2


def _standard_classes() -> dict[str, PriorityClass]:
    classes = (
        PriorityClass("critical", 100, preempting=True, cost_sensitivity=0.0),
        PriorityClass("high", 50, preempting=True, cost_sensitivity=0.5),
        PriorityClass("normal", 10),
        PriorityClass("low", 0),
    )
    return {c.name: c for c in classes}


@dataclass(frozen=True)
class Policy:
    priority_classes: Mapping[str, PriorityClass] = field(default_factory=_standard_classes)
    default_priority_class: str = "normal"
    tenants: Mapping[str, TenantPolicy] = field(default_factory=dict)
    accelerator_types: Mapping[str, AcceleratorModel] = field(default_factory=dict)
    # Fallback prices per accelerator-hour when a cluster lists none for a type and tier.
    prices: Mapping[tuple[str, PriceTier], float] = field(default_factory=dict)
    ordering: OrderingMode = OrderingMode.FAIR_SHARE
    fair_share: FairShare = FairShare()
    placement: PlacementPreferences = PlacementPreferences()
    backfill: Backfill = Backfill()
    preemption: Preemption = Preemption()
    las: Las = Las()
    service_levels: ServiceLevels = ServiceLevels()

    @classmethod
    def default(cls) -> Policy:
        return cls()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Policy:
        return _parse_policy(d)

    def rank(self, priority_class: str) -> int:
        pc = self.priority_classes.get(priority_class)
        if pc is None:
            pc = self.priority_classes.get(self.default_priority_class)
        return pc.rank if pc is not None else 0

    def priority(self, priority_class: str) -> PriorityClass:
        pc = self.priority_classes.get(priority_class)
        if pc is None:
            pc = self.priority_classes.get(self.default_priority_class)
        return pc if pc is not None else PriorityClass(priority_class, 0)

    def tenant(self, name: str) -> TenantPolicy | None:
        return self.tenants.get(name)

    def cohort_members(self, cohort: str) -> tuple[TenantPolicy, ...]:
        return tuple(t for _, t in sorted(self.tenants.items()) if t.cohort == cohort)


# --- parsing: one small function per section; every error names its key -------------------


def _parse_policy(d: Mapping[str, Any]) -> Policy:
    _expect_mapping(d, "policy")
    known = {
        "priority_classes",
        "default_priority_class",
        "tenants",
        "accelerator_types",
        "prices",
        "ordering",
        "fair_share",
        "placement",
        "backfill",
        "preemption",
        "las",
        "service_levels",
    }
    unknown = sorted(set(d) - known)
    if unknown:
        raise PolicyError(f"policy: unknown section(s) {unknown}; expected some of {sorted(known)}")
    classes = _parse_classes(d.get("priority_classes"))
    default_class = _str(d.get("default_priority_class", "normal"), "default_priority_class")
    if default_class not in classes:
        raise PolicyError(f"default_priority_class {default_class!r} is not a priority class")
    return Policy(
        priority_classes=classes,
        default_priority_class=default_class,
        tenants=_parse_tenants(d.get("tenants", {})),
        accelerator_types=_parse_types(d.get("accelerator_types", {})),
        prices=_parse_prices(d.get("prices", {}), "prices"),
        ordering=_enum(OrderingMode, d.get("ordering", "fair_share"), "ordering"),
        fair_share=FairShare(**_section(d.get("fair_share", {}), "fair_share", FairShare)),
        placement=_parse_placement(d.get("placement", {})),
        backfill=_parse_backfill(d.get("backfill", {})),
        preemption=_parse_preemption(d.get("preemption", {})),
        las=_parse_las(d.get("las", {})),
        service_levels=_parse_service_levels(d.get("service_levels", {})),
    )


def _parse_classes(raw: Any) -> dict[str, PriorityClass]:
    if raw is None:
        return _standard_classes()
    if not isinstance(raw, list) or not raw:
        raise PolicyError("priority_classes: expected a non-empty list of {name, rank, ...}")
    classes: dict[str, PriorityClass] = {}
    for i, item in enumerate(raw):
        where = f"priority_classes[{i}]"
        _expect_mapping(item, where)
        name = _str(item.get("name"), f"{where}.name")
        if name in classes:
            raise PolicyError(f"{where}: duplicate priority class {name!r}")
        _no_unknown(item, where, {"name", "rank", "preempting", "cost_sensitivity"})
        classes[name] = PriorityClass(
            name=name,
            rank=_int(item.get("rank"), f"{where}.rank"),
            preempting=_bool(item.get("preempting", False), f"{where}.preempting"),
            cost_sensitivity=_num(item.get("cost_sensitivity", 1.0), f"{where}.cost_sensitivity"),
        )
    return classes


def _parse_tenants(raw: Any) -> dict[str, TenantPolicy]:
    _expect_mapping(raw, "tenants")
    keys = {
        "queues",
        "max_replicas",
        "max_accelerators",
        "weight",
        "cohort",
        "quotas",
        "borrow_limit",
        "lend_limit",
    }
    tenants: dict[str, TenantPolicy] = {}
    for name, item in raw.items():
        where = f"tenants.{name}"
        item = {} if item is None else item
        _expect_mapping(item, where)
        _no_unknown(item, where, keys)
        queues = item.get("queues", ["default"])
        if not isinstance(queues, list) or not all(isinstance(q, str) for q in queues):
            raise PolicyError(f"{where}.queues: expected a list of queue names")
        weight = _num(item.get("weight", 1.0), f"{where}.weight")
        if weight <= 0:
            raise PolicyError(f"{where}.weight: must be positive, got {weight}")
        cohort = item.get("cohort")
        tenants[str(name)] = TenantPolicy(
            name=str(name),
            queues=tuple(queues),
            max_replicas=_int(item.get("max_replicas", 64), f"{where}.max_replicas"),
            max_accelerators=_num(item.get("max_accelerators", 512), f"{where}.max_accelerators"),
            weight=weight,
            cohort=None if cohort is None else _str(cohort, f"{where}.cohort"),
            quotas=None if "quotas" not in item else _amounts(item["quotas"], f"{where}.quotas"),
            borrow_limit=_amounts(item.get("borrow_limit", {}), f"{where}.borrow_limit"),
            lend_limit=_amounts(item.get("lend_limit", {}), f"{where}.lend_limit"),
        )
    return tenants


def _parse_types(raw: Any) -> dict[str, AcceleratorModel]:
    _expect_mapping(raw, "accelerator_types")
    types: dict[str, AcceleratorModel] = {}
    for name, item in raw.items():
        where = f"accelerator_types.{name}"
        _expect_mapping(item, where)
        _no_unknown(item, where, {"generation", "memory_gb", "relative_speed"})
        speed = _num(item.get("relative_speed", 1.0), f"{where}.relative_speed")
        if speed <= 0:
            raise PolicyError(f"{where}.relative_speed: must be positive, got {speed}")
        types[str(name)] = AcceleratorModel(
            type=str(name),
            generation=_str(item.get("generation", "unknown"), f"{where}.generation"),
            memory_gb=_num(item.get("memory_gb"), f"{where}.memory_gb"),
            relative_speed=speed,
        )
    return types


def _parse_prices(raw: Any, where: str) -> dict[tuple[str, PriceTier], float]:
    _expect_mapping(raw, where)
    prices: dict[tuple[str, PriceTier], float] = {}
    for type_name, tiers in raw.items():
        _expect_mapping(tiers, f"{where}.{type_name}")
        for tier, price in tiers.items():
            key = f"{where}.{type_name}.{tier}"
            prices[(str(type_name), _enum(PriceTier, tier, key))] = price_per_hour(price, key)
    return prices


def price_per_hour(value: Any, where: str) -> float:
    """A price per accelerator-hour from a policy or fleet file: a number from 0 to MAX_PRICE
    (the bound the wire holds executors' announced prices to, schemas.bounds.MAX_PRICE)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_PRICE  # also NaN
    ):
        raise PolicyError(
            f"{where}: expected a price per accelerator-hour from 0 to {MAX_PRICE:,.0f},"
            f" got {value!r}"
        )
    return float(value)


def _parse_placement(raw: Any) -> PlacementPreferences:
    return PlacementPreferences(**_section(raw, "placement", PlacementPreferences))


def _parse_backfill(raw: Any) -> Backfill:
    values = _section(raw, "backfill", Backfill)
    if "mode" in values:
        values["mode"] = _enum(BackfillMode, values["mode"], "backfill.mode")
    return Backfill(**values)


def _parse_preemption(raw: Any) -> Preemption:
    return Preemption(**_section(raw, "preemption", Preemption))


def _section(raw: Any, where: str, cls: type) -> dict[str, Any]:
    """A flat section of dataclass `cls`: its fields only; a flag must be true or false and a
    number finite and >= 0 (a NaN would make every comparison false, and a score of NaN or a
    negative weight would turn a preference around). Names (modes) are checked by the caller."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    fields = _fields(raw, where, set(defaults))
    for key, value in fields.items():
        default = defaults[key]
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise PolicyError(f"{where}.{key}: expected true or false, got {value!r}")
        elif isinstance(default, int | float) and (
            isinstance(value, bool | str) or not (0 <= value < math.inf)
        ):
            raise PolicyError(f"{where}.{key}: expected a number >= 0, got {value!r}")
    return fields


def _parse_las(raw: Any) -> Las:
    _expect_mapping(raw, "las")
    _no_unknown(raw, "las", {"thresholds"})
    thresholds = raw.get("thresholds", list(Las().thresholds))
    if not isinstance(thresholds, list) or sorted(thresholds) != thresholds:
        raise PolicyError("las.thresholds: expected an ascending list of accelerator-seconds")
    return Las(thresholds=tuple(_num(t, "las.thresholds[]") for t in thresholds))


def _parse_service_levels(raw: Any) -> ServiceLevels:
    where = "service_levels"
    keys = {"mode", "base_s", "ratio", "levels", "min_samples", "refresh_s", "preempt_gap"}
    fields = _fields(raw, where, keys)
    default = ServiceLevels()
    mode = _enum(LevelMode, fields.pop("mode", default.mode.value), f"{where}.mode")
    # A NaN or an infinity here would put every job in one level or none: refused by name.
    base_s = _num(fields.get("base_s", default.base_s), f"{where}.base_s")
    ratio = _num(fields.get("ratio", default.ratio), f"{where}.ratio")
    if not (1 <= base_s <= 1e12):
        raise PolicyError(f"{where}.base_s: expected 1 to 1e12 accelerator-seconds, got {base_s}")
    if not (1.01 <= ratio <= 1e6):
        raise PolicyError(f"{where}.ratio: expected 1.01 to 1e6, got {ratio}")
    counts = {}
    for key, high in (("levels", 64), ("min_samples", 256), ("preempt_gap", 64)):
        counts[key] = _int(fields.get(key, getattr(default, key)), f"{where}.{key}")
        if not 1 <= counts[key] <= high:
            raise PolicyError(f"{where}.{key}: expected 1 to {high}, got {counts[key]}")
    refresh_s = _num(fields.get("refresh_s", default.refresh_s), f"{where}.refresh_s")
    if not (0 <= refresh_s <= 1e9):
        raise PolicyError(f"{where}.refresh_s: expected 0 to 1e9 seconds, got {refresh_s}")
    return ServiceLevels(mode=mode, base_s=base_s, ratio=ratio, refresh_s=refresh_s, **counts)


def _fields(raw: Any, where: str, keys: set[str]) -> dict[str, Any]:
    """Checks a flat section: known keys only, and each value of the default's type."""
    _expect_mapping(raw, where)
    _no_unknown(raw, where, keys)
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, bool | str):
            out[key] = value
        elif isinstance(value, int | float):
            out[key] = float(value) if not key.startswith("max_") else _int(value, f"{where}.{key}")
        else:
            raise PolicyError(f"{where}.{key}: expected a number, boolean or name, got {value!r}")
    return out


def _amounts(raw: Any, where: str) -> dict[str, float]:
    _expect_mapping(raw, where)
    amounts = {str(k): _num(v, f"{where}.{k}") for k, v in raw.items()}
    negative = [k for k, v in amounts.items() if v < 0]
    if negative:
        raise PolicyError(f"{where}: negative amount for {negative}")
    return amounts


def _expect_mapping(value: Any, where: str) -> None:
    if not isinstance(value, Mapping):
        raise PolicyError(f"{where}: expected a mapping, got {type(value).__name__}")


def _no_unknown(item: Mapping[str, Any], where: str, keys: set[str]) -> None:
    unknown = sorted(set(item) - keys)
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(keys)}")


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise PolicyError(f"{where}: expected a non-empty name, got {value!r}")
    return value


def _num(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _int(value: Any, where: str) -> int:
    # A NaN or an infinity is no integer (and int() of one raises a bare ValueError).
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise PolicyError(f"{where}: expected an integer, got {value!r}")
    return int(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"{where}: expected true or false, got {value!r}")
    return value


def _enum(kind: type[_E], value: Any, where: str) -> _E:
    # YAML 1.1 reads an unquoted `off` as false: that is what the writer meant.
    if value is False and "off" in {m.value for m in kind}:
        value = "off"
    try:
        return kind(value)
    except ValueError:
        allowed = [m.value for m in kind]
        raise PolicyError(f"{where}: {value!r} is not one of {allowed}") from None
