"""Inference services for people and routers: declare one (`POST /v1/services`, `qm serve`),
scale it, pause, resume or undo its rollout, delete it; read each service's status, replicas,
endpoints and history (scale events, rollout steps, roll-backs, with their reasons).

The gateway publishes the commands (`service.declared`, `service.command`) and answers from its
projection of `service.status`, which the serving service publishes on every change. A
declaration is checked here first (its replica job must pass the queue's admission, and the
name must not be another tenant's), so a mistake is a 4xx now rather than a silent refusal.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

import asyncpg
from aiokafka import ConsumerRecord
from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, Field, ValidationError

from schemas import topics
from schemas.bounds import Name
from schemas.serving import (
    MAX_SERVICE_REPLICAS,
    ServiceAction,
    ServiceCommand,
    ServiceDeclared,
    ServiceName,
    ServiceSpec,
    ServiceStatus,
)
from schemas.validation import describe_validation_error
from services.common.admission import check_admission
from services.common.deadletter import decode_payloads
from services.common.kafka import OutMessage, envelope_for, publish_all
from services.gateway.auth import Principal
from services.gateway.context import Gateway
from services.gateway.deps import gateway, principal

router = APIRouter(prefix="/v1")
SERVICE_TOPICS = (topics.SERVICE_STATUS,)
HISTORY_KEPT = 200

GatewayDep = Annotated[Gateway, Depends(gateway)]
PrincipalDep = Annotated[Principal, Depends(principal)]


class Accepted(BaseModel):
    service: str
    action: str
    message: str


class HistoryEntry(BaseModel):
    revision: int
    change: str
    reason: str
    version: str
    desired_replicas: int
    ready_replicas: int
    at: datetime


class ServiceView(BaseModel):
    status: ServiceStatus
    at: datetime
    history: list[HistoryEntry] = Field(default_factory=list)


class ServiceList(BaseModel):
    services: list[ServiceView]


class DeclareService(ServiceSpec):
    """A service's spec; the tenant defaults to the token's."""

    tenant: Name | None = None  # type: ignore[assignment]


class ScaleBody(BaseModel):
    min_replicas: int | None = Field(default=None, ge=1, le=MAX_SERVICE_REPLICAS)
    max_replicas: int | None = Field(default=None, ge=1, le=MAX_SERVICE_REPLICAS)
    replicas: int | None = Field(
        default=None, ge=1, le=MAX_SERVICE_REPLICAS, description="A fixed count (min = max)."
    )


async def record_services(
    pool: asyncpg.Pool, records: tuple[ConsumerRecord[Any, Any], ...]
) -> list[OutMessage]:
    """Keep each service's newest status and its history of changes; dead letters for the
    rest."""
    received, dead = decode_payloads(
        records, {topics.SERVICE_STATUS: ServiceStatus}, consumer="gateway"
    )
    latest: dict[str, tuple[Any, ...]] = {}
    history: list[tuple[Any, ...]] = []
    for got, s in received:
        at = got.envelope.occurred_at
        latest[s.service] = (s.service, s.tenant, s.model_dump_json(), s.revision, at)
        if s.change:
            history.append(
                (
                    s.service,
                    s.tenant,
                    s.revision,
                    s.change,
                    s.reason,
                    s.version,
                    s.desired_replicas,
                    s.ready_replicas,
                    at,
                )
            )
    async with pool.acquire() as conn, conn.transaction():
        if latest:
            await conn.executemany(
                "INSERT INTO gateway.services (name, tenant, status, revision, at)"
                " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO UPDATE SET"
                " tenant = EXCLUDED.tenant, status = EXCLUDED.status,"
                " revision = EXCLUDED.revision, at = EXCLUDED.at"
                " WHERE gateway.services.at <= EXCLUDED.at",
                list(latest.values()),
            )
        if history:
            await conn.executemany(
                "INSERT INTO gateway.service_history (service, tenant, revision, change, reason,"
                " version, desired_replicas, ready_replicas, at)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (service, revision)"
                " DO UPDATE SET tenant = EXCLUDED.tenant, change = EXCLUDED.change,"
                " reason = EXCLUDED.reason, version = EXCLUDED.version,"
                " desired_replicas = EXCLUDED.desired_replicas,"
                " ready_replicas = EXCLUDED.ready_replicas, at = EXCLUDED.at",
                history,
            )
            await conn.execute(
                "DELETE FROM gateway.service_history h USING (SELECT service, revision,"
                " row_number() OVER (PARTITION BY service ORDER BY revision DESC) AS n"
                " FROM gateway.service_history WHERE service = ANY($2::text[])) old"
                " WHERE h.service = old.service AND h.revision = old.revision AND old.n > $1",
                HISTORY_KEPT,
                sorted({h[0] for h in history}),
            )
    return dead


def _unseen(name: str) -> HTTPException:
    return HTTPException(404, detail=f"no service {name} visible to this token")


async def _row(gw: Gateway, name: str) -> asyncpg.Record | None:
    return await gw.pool.fetchrow("SELECT * FROM gateway.services WHERE name = $1", name)


async def publish_command(gw: Gateway, message: OutMessage) -> None:
    try:
        await publish_all(gw.broker, [message])
    except Exception as exc:
        raise HTTPException(503, detail="the log is unavailable; retry shortly") from exc


def _deleted(row: asyncpg.Record) -> bool:
    return bool(json.loads(row["status"]).get("phase") == "deleted")


@router.post("/services", status_code=202, response_model=Accepted)
async def declare_service(body: DeclareService, gw: GatewayDep, who: PrincipalDep) -> Accepted:
    """Declare an inference service, or its new desired state (a new `version` rolls out)."""
    tenant = body.tenant or who.tenant
    if not who.can_change(tenant):
        raise HTTPException(
            403,
            detail=f"a {who.role.value} token of tenant {who.tenant!r} cannot declare "
            f"services for tenant {tenant!r}",
        )
    try:
        spec = ServiceSpec.model_validate({**body.model_dump(), "tenant": tenant})
    except ValidationError as exc:
        raise HTTPException(
            422, detail={"reason_code": "invalid_spec", "message": describe_validation_error(exc)}
        ) from exc
    rejection = check_admission(spec.replica_job(f"svc-{spec.name}-0", guaranteed=True), gw.policy)
    if rejection is not None:
        raise HTTPException(
            422, detail={"reason_code": rejection.reason.value, "message": rejection.message}
        )
    row = await _row(gw, spec.name)
    if row is not None and row["tenant"] != tenant and not _deleted(row):
        raise HTTPException(409, detail=f"the service name {spec.name!r} is taken; pick another")
    declared = ServiceDeclared(spec=spec, declared_by=who.tenant)
    env = envelope_for("ServiceDeclared", declared, producer="gateway", tenant=tenant)
    await publish_command(gw, OutMessage(topics.SERVICE_DECLARED, spec.name, env))
    return Accepted(
        service=spec.name,
        action="declare",
        message=f"{spec.model} {spec.version}: {spec.min_replicas} to {spec.max_replicas} "
        "replica(s); follow it with GET /v1/services/" + spec.name,
    )


@router.get("/services", response_model=ServiceList)
async def list_services(gw: GatewayDep, who: PrincipalDep) -> ServiceList:
    if who.sees_all:
        rows = await gw.pool.fetch("SELECT * FROM gateway.services ORDER BY name")
    else:
        rows = await gw.pool.fetch(
            "SELECT * FROM gateway.services WHERE tenant = $1 ORDER BY name", who.tenant
        )
    return ServiceList(
        services=[
            ServiceView(status=ServiceStatus.model_validate_json(r["status"]), at=r["at"])
            for r in rows
            if not _deleted(r)
        ]
    )


@router.get("/services/{name}", response_model=ServiceView)
async def get_service(name: ServiceName, gw: GatewayDep, who: PrincipalDep) -> ServiceView:
    row = await _row(gw, name)
    if row is None or not who.can_read(row["tenant"]):
        raise _unseen(name)
    history = await gw.pool.fetch(
        "SELECT * FROM gateway.service_history WHERE service = $1 AND tenant = $2"
        " ORDER BY revision DESC LIMIT 50",
        name,
        row["tenant"],
    )
    return ServiceView(
        status=ServiceStatus.model_validate_json(row["status"]),
        at=row["at"],
        history=[
            HistoryEntry(
                revision=h["revision"],
                change=h["change"],
                reason=h["reason"],
                version=h["version"],
                desired_replicas=h["desired_replicas"],
                ready_replicas=h["ready_replicas"],
                at=h["at"],
            )
            for h in history
        ],
    )


@router.get("/services/{name}/endpoints")
async def get_endpoints(name: ServiceName, gw: GatewayDep, who: PrincipalDep) -> dict[str, Any]:
    """The replicas ready to serve and their addresses (what a router sends requests to)."""
    view = await get_service(name, gw, who)
    return {
        "service": name,
        "endpoints": [e.model_dump() for e in view.status.endpoints],
        "at": view.at,
    }


async def _command(
    gw: Gateway, who: Principal, name: str, action: ServiceAction, **counts: int | None
) -> Accepted:
    row = await _row(gw, name)
    if row is None or _deleted(row) or not who.can_read(row["tenant"]):
        raise _unseen(name)
    if not who.can_change(row["tenant"]):
        raise HTTPException(403, detail=f"a {who.role.value} token cannot change services")
    try:
        command = ServiceCommand(
            service=name, tenant=row["tenant"], action=action, requested_by=who.tenant, **counts
        )
    except ValidationError as exc:
        raise HTTPException(
            422,
            detail={"reason_code": "invalid_command", "message": describe_validation_error(exc)},
        ) from exc
    env = envelope_for("ServiceCommand", command, producer="gateway", tenant=row["tenant"])
    await publish_command(gw, OutMessage(topics.SERVICE_COMMAND, name, env))
    return Accepted(service=name, action=action.value, message=f"{action.value} sent")


@router.post("/services/{name}/scale", status_code=202, response_model=Accepted)
async def scale_service(
    name: ServiceName, body: ScaleBody, gw: GatewayDep, who: PrincipalDep
) -> Accepted:
    low, high = body.min_replicas, body.max_replicas
    if body.replicas is not None:
        if low is not None or high is not None:
            raise HTTPException(422, detail="give replicas, or min_replicas/max_replicas")
        low = high = body.replicas
    return await _command(gw, who, name, ServiceAction.SCALE, min_replicas=low, max_replicas=high)


@router.post("/services/{name}/rollout/{action}", status_code=202, response_model=Accepted)
async def rollout_action(
    name: ServiceName, action: Name, gw: GatewayDep, who: PrincipalDep
) -> Accepted:
    allowed = {
        "pause": ServiceAction.PAUSE,
        "resume": ServiceAction.RESUME,
        "undo": ServiceAction.UNDO,
    }
    if action not in allowed:
        raise HTTPException(404, detail=f"no rollout action {action!r}: pause, resume or undo")
    return await _command(gw, who, name, allowed[action])


@router.delete("/services/{name}", status_code=202, response_model=Accepted)
async def delete_service(name: ServiceName, gw: GatewayDep, who: PrincipalDep) -> Accepted:
    return await _command(gw, who, name, ServiceAction.DELETE)
