"""Usage and cost for people and finance: the gateway's projection of `usage.tick` into its
own schema, and `GET /v1/usage` (JSON or CSV) and `GET /v1/usage/efficiency` answered from it.

Tenants see only their own usage; the finance and admin roles see every tenant's. Fleet
efficiency (allocated against idle accelerator-seconds) is for finance, admin and ops.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any

import asyncpg
from aiokafka import ConsumerRecord
from fastapi import APIRouter, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from schemas import topics
from schemas.usage import UsageTick
from services.common.deadletter import decode_payloads
from services.common.kafka import OutMessage
from services.gateway.auth import Principal, Role
from services.gateway.routes import GatewayDep, PrincipalDep

USAGE_TOPICS = (topics.USAGE_TICK,)

# group_by name -> SQL expression over gateway.usage_ticks (a whitelist: never user text in SQL)
DIMENSIONS: dict[str, str] = {
    "tenant": "tenant",
    "project": "project",
    "user": '"user"',
    "cluster": "cluster",
    "accelerator_type": "accelerator_type",
    "price_tier": "price_tier",
    "kind": "kind",
    "job_id": "job_id",
    "day": "to_char(interval_start AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
    "month": "to_char(interval_start AT TIME ZONE 'UTC', 'YYYY-MM')",
}
USAGE_READERS = (Role.ADMIN, Role.FINANCE)
FLEET_READERS = (Role.ADMIN, Role.FINANCE, Role.OPS)
_MICRO = Decimal("0.000001")


# --- projection ----------------------------------------------------------------------------


class UsageProjector:
    """Writes each usage tick once; a redelivered tick (same tick_id) changes nothing."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.skipped = 0
        self.projected = 0  # ticks new to the read model

    async def process(self, records: tuple[ConsumerRecord[Any, Any], ...]) -> list[OutMessage]:
        """Project the ticks; returns dead letters for the records that are not ticks (the
        gateway is the only consumer of usage.tick with a store: finance reads the topic)."""
        received, dead = decode_payloads(
            records, dict.fromkeys(USAGE_TOPICS, UsageTick), consumer="gateway"
        )
        self.skipped += len(dead)
        ticks: list[UsageTick] = [tick for _, tick in received]
        if not ticks:
            return dead
        rows = await self.pool.fetch(
            "INSERT INTO gateway.usage_ticks (tick_id, kind, run_id, job_id, tenant, project,"
            ' "user", cluster, accelerator_type, price_tier, interval_index, interval_start,'
            " interval_end, count, seconds, accelerator_seconds, unit_price, cost, currency,"
            " outcome) SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[],"
            " $5::text[], $6::text[], $7::text[], $8::text[], $9::text[], $10::text[],"
            " $11::bigint[], $12::timestamptz[], $13::timestamptz[], $14::numeric[],"
            " $15::numeric[], $16::numeric[], $17::numeric[], $18::numeric[], $19::text[],"
            " $20::text[]) ON CONFLICT (tick_id) DO NOTHING RETURNING tick_id",
            *_columns(ticks),
        )
        self.projected += len(rows)
        return dead


def _num(value: float) -> Decimal:
    return Decimal(str(value))  # the digits on the wire, not their binary neighbour


def _columns(ticks: list[UsageTick]) -> list[list[Any]]:
    return [
        [t.tick_id for t in ticks],
        [t.kind.value for t in ticks],
        [t.run_id for t in ticks],
        [t.job_id for t in ticks],
        [t.tenant for t in ticks],
        [t.project for t in ticks],
        [t.user for t in ticks],
        [t.cluster for t in ticks],
        [t.accelerator_type for t in ticks],
        [t.price_tier for t in ticks],
        [t.interval_index for t in ticks],
        [t.interval_start for t in ticks],
        [t.interval_end for t in ticks],
        [_num(t.count) for t in ticks],
        [_num(t.seconds) for t in ticks],
        [_num(t.accelerator_seconds) for t in ticks],
        [_num(t.unit_price) for t in ticks],
        [_num(t.cost) for t in ticks],
        [t.currency for t in ticks],
        [t.outcome for t in ticks],
    ]


# --- queries -------------------------------------------------------------------------------


class UsageReport(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    from_: datetime = Field(alias="from")
    to: datetime
    group_by: list[str]
    rows: list[dict[str, Any]] = Field(
        description="One per group: the group_by values, currency, accelerator_seconds, "
        "accelerator_hours, cost, runs (distinct runs metered) and ticks."
    )
    total: dict[str, Any]


class EfficiencyReport(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    from_: datetime = Field(alias="from")
    to: datetime
    rows: list[dict[str, Any]] = Field(
        description="Per cluster and accelerator type: allocated and idle accelerator-seconds, "
        "efficiency (allocated share), idle cost."
    )


def parse_group_by(raw: str) -> list[str]:
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in DIMENSIONS]
    if unknown:
        raise HTTPException(
            422,
            detail=f"cannot group by {', '.join(unknown)}; choose from {', '.join(DIMENSIONS)}",
        )
    return list(dict.fromkeys(names))


def window(
    start: datetime | None, end: datetime | None, now: datetime
) -> tuple[datetime, datetime]:
    """[from, to) in UTC: by default from the start of this month until now."""
    end = _utc(end) if end else now
    start = _utc(start) if start else end.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    if start >= end:
        raise HTTPException(422, detail="`from` must be before `to`")
    return start, end


def _utc(at: datetime) -> datetime:
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def scope_tenant(who: Principal, tenant: str | None) -> str | None:
    """The tenant a caller may see: any (None) for finance and admin, else only its own."""
    if who.role in USAGE_READERS:
        return tenant
    if tenant is not None and tenant != who.tenant:
        raise HTTPException(403, detail=f"this token may only see tenant {who.tenant!r}'s usage")
    return who.tenant


KINDS = ("usage", "idle", "interval", "close")  # usage: every kind but idle


def usage_sql(group_by: list[str], tenant: str | None, kind: str | None) -> str:
    """The aggregate query: $1 from, $2 to, then $3 the tenant if one is given."""
    dims = [f"{DIMENSIONS[g]} AS {g}" for g in group_by]
    where = ["interval_start >= $1", "interval_start < $2"]
    if tenant is not None:
        where.append("tenant = $3")
    if kind is not None:
        if kind not in KINDS:
            raise HTTPException(422, detail=f"kind must be one of {', '.join(KINDS)}")
        where.append("kind <> 'idle'" if kind == "usage" else f"kind = '{kind}'")
    keys = [*group_by, "currency"]
    return (
        f"SELECT {', '.join([*dims, 'currency'])}, sum(accelerator_seconds) AS acc_s, "
        "sum(cost) AS cost, count(*) AS ticks, "
        "count(DISTINCT run_id) FILTER (WHERE kind <> 'idle') AS runs "
        f"FROM gateway.usage_ticks WHERE {' AND '.join(where)} "
        f"GROUP BY {', '.join(keys)} ORDER BY {', '.join(keys)}"
    )


def _row(r: asyncpg.Record, group_by: list[str]) -> dict[str, Any]:
    acc = r["acc_s"] or Decimal(0)
    return {
        **{g: r[g] for g in group_by},
        "currency": r["currency"],
        "accelerator_seconds": acc.quantize(_MICRO),
        "accelerator_hours": (acc / 3600).quantize(_MICRO),
        "cost": (r["cost"] or Decimal(0)).quantize(_MICRO),
        "runs": r["runs"],
        "ticks": r["ticks"],
    }


def _total(rows: list[dict[str, Any]]) -> dict[str, Any]:
    currencies = sorted({r["currency"] for r in rows})
    return {
        "currency": currencies[0] if len(currencies) == 1 else currencies or None,
        "accelerator_seconds": sum((r["accelerator_seconds"] for r in rows), Decimal(0)),
        "accelerator_hours": sum((r["accelerator_hours"] for r in rows), Decimal(0)),
        "cost": sum((r["cost"] for r in rows), Decimal(0)),
        "ticks": sum(r["ticks"] for r in rows),
    }


def _json_ready(row: dict[str, Any]) -> dict[str, Any]:
    return {k: float(v) if isinstance(v, Decimal) else v for k, v in row.items()}


def as_csv(rows: list[dict[str, Any]], columns: list[str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else str(v) for k, v in row.items()})
    return out.getvalue()


def wants_csv(request: Request, fmt: str | None) -> bool:
    if fmt is not None:
        if fmt not in ("json", "csv"):
            raise HTTPException(422, detail="format must be json or csv")
        return fmt == "csv"
    return "text/csv" in request.headers.get("accept", "")


# --- routes --------------------------------------------------------------------------------

router = APIRouter(prefix="/v1", tags=["usage"])

FromQuery = Annotated[
    datetime | None, Query(alias="from", description="Start (ISO 8601; UTC if no zone).")
]
ToQuery = Annotated[datetime | None, Query(description="End, exclusive. Default: now.")]


@router.get(
    "/usage",
    response_model=UsageReport,
    responses={200: {"content": {"text/csv": {}}}, 403: {}, 422: {}},
)
async def usage(
    request: Request,
    gw: GatewayDep,
    who: PrincipalDep,
    start: FromQuery = None,
    end: ToQuery = None,
    group_by: Annotated[
        str, Query(description=f"Comma-separated, of: {', '.join(DIMENSIONS)}.")
    ] = "tenant",
    tenant: Annotated[str | None, Query()] = None,
    kind: Annotated[str | None, Query(description=" | ".join(KINDS))] = None,
    fmt: Annotated[str | None, Query(alias="format", description="json | csv")] = None,
) -> Any:
    """Accelerator-seconds, accelerator-hours and cost over [from, to), grouped. Ticks count
    in the window their span starts in. `Accept: text/csv` or `format=csv` for CSV."""
    dims = parse_group_by(group_by)
    frm, to = window(start, end, datetime.now(UTC))
    scoped = scope_tenant(who, tenant)
    sql = usage_sql(dims, scoped, kind)
    args: list[Any] = [frm, to] if scoped is None else [frm, to, scoped]
    rows = [_row(r, dims) for r in await gw.pool.fetch(sql, *args)]
    if wants_csv(request, fmt):
        columns = [*dims, "currency", "accelerator_seconds", "accelerator_hours", "cost", "runs"]
        return Response(as_csv(rows, columns), media_type="text/csv")
    return UsageReport.model_validate(
        {
            "from": frm,
            "to": to,
            "group_by": dims,
            "rows": [_json_ready(r) for r in rows],
            "total": _json_ready(_total(rows)),
        }
    )


@router.get("/usage/efficiency", response_model=EfficiencyReport, responses={403: {}})
async def efficiency(
    gw: GatewayDep, who: PrincipalDep, start: FromQuery = None, end: ToQuery = None
) -> EfficiencyReport:
    """Allocated against idle accelerator-seconds per cluster and accelerator type."""
    if who.role not in FLEET_READERS:
        raise HTTPException(403, detail="fleet efficiency is for the finance, admin and ops roles")
    frm, to = window(start, end, datetime.now(UTC))
    records = await gw.pool.fetch(
        "SELECT cluster, accelerator_type, "
        "coalesce(sum(accelerator_seconds) FILTER (WHERE kind <> 'idle'), 0) AS allocated, "
        "coalesce(sum(accelerator_seconds) FILTER (WHERE kind = 'idle'), 0) AS idle, "
        "coalesce(sum(cost) FILTER (WHERE kind = 'idle'), 0) AS idle_cost "
        "FROM gateway.usage_ticks WHERE interval_start >= $1 AND interval_start < $2 "
        "GROUP BY cluster, accelerator_type ORDER BY cluster, accelerator_type",
        frm,
        to,
    )
    rows = []
    for r in records:
        capacity = r["allocated"] + r["idle"]
        rows.append(
            {
                "cluster": r["cluster"],
                "accelerator_type": r["accelerator_type"],
                "allocated_accelerator_seconds": float(r["allocated"]),
                "idle_accelerator_seconds": float(r["idle"]),
                "efficiency": float(round(r["allocated"] / capacity, 6)) if capacity else None,
                "idle_cost": float(r["idle_cost"]),
            }
        )
    return EfficiencyReport.model_validate({"from": frm, "to": to, "rows": rows})
