"""Robot fleets for people: the robots each edge executor reports (`GET /v1/robots`,
`qm robots`), and model deployments to them (`POST /v1/deployments`, `qm deploy`): declare one,
pause, resume or undo it, pin or unpin a robot; read each deployment's waves, robots on the
version and history.

The gateway publishes the commands (`deployment.declared`, `deployment.command`) and answers
from its projections of `robot.inventory` and `deployment.status`.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

import asyncpg
from aiokafka import ConsumerRecord
from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel, Field, ValidationError, field_validator

from schemas import topics
from schemas.bounds import Name
from schemas.robots import (
    DeploymentAction,
    DeploymentCommand,
    DeploymentDeclared,
    DeploymentName,
    DeploymentStatus,
    RobotDeploymentSpec,
    RobotId,
    RobotInventory,
    RobotSelector,
    RobotState,
)
from schemas.validation import describe_validation_error
from services.common.deadletter import decode_payloads
from services.common.kafka import OutMessage, envelope_for
from services.gateway.auth import Principal
from services.gateway.context import Gateway
from services.gateway.deps import gateway, principal
from services.gateway.serving import publish_command

router = APIRouter(prefix="/v1")
ROBOT_TOPICS = (topics.ROBOT_INVENTORY, topics.DEPLOYMENT_STATUS)
HISTORY_KEPT = 200

GatewayDep = Annotated[Gateway, Depends(gateway)]
PrincipalDep = Annotated[Principal, Depends(principal)]


class Accepted(BaseModel):
    deployment: str
    action: str
    message: str


class RobotView(RobotState):
    cluster: str


class RobotList(BaseModel):
    robots: list[RobotView]
    online: int
    total: int


class DeploymentHistory(BaseModel):
    revision: int
    phase: str
    version: str
    wave: int
    waves: int
    on_version: int
    reason: str
    at: datetime


class DeploymentView(BaseModel):
    status: DeploymentStatus
    at: datetime
    history: list[DeploymentHistory] = Field(default_factory=list)


class DeploymentList(BaseModel):
    deployments: list[DeploymentView]


class DeclareDeployment(RobotDeploymentSpec):
    """A deployment; `to` may be a selector string (`site=lab-a,robot_model=mk2`); the tenant
    defaults to the token's."""

    tenant: Name | None = None  # type: ignore[assignment]

    @field_validator("to", mode="before")
    @classmethod
    def _selector(cls, value: Any) -> Any:
        return RobotSelector.parse(value) if isinstance(value, str) else value


class PinBody(BaseModel):
    robot: RobotId
    version: Name | None = None


async def record_robots(
    pool: asyncpg.Pool, records: tuple[ConsumerRecord[Any, Any], ...]
) -> list[OutMessage]:
    received, dead = decode_payloads(
        records,
        {topics.ROBOT_INVENTORY: RobotInventory, topics.DEPLOYMENT_STATUS: DeploymentStatus},
        consumer="gateway",
    )
    fleets: dict[str, tuple[Any, ...]] = {}
    latest: dict[str, tuple[Any, ...]] = {}
    history: list[tuple[Any, ...]] = []
    for got, p in received:
        at = got.envelope.occurred_at
        if isinstance(p, RobotInventory):
            fleets[p.cluster] = (p.cluster, p.model_dump_json(), at)
        elif isinstance(p, DeploymentStatus):
            latest[p.deployment] = (p.deployment, p.tenant, p.model_dump_json(), p.revision, at)
            history.append(
                (
                    p.deployment,
                    p.revision,
                    p.phase.value,
                    p.version,
                    p.wave,
                    p.waves,
                    p.on_version,
                    p.reason,
                    at,
                )
            )
    async with pool.acquire() as conn, conn.transaction():
        if fleets:
            await conn.executemany(
                "INSERT INTO gateway.robot_fleets (cluster, inventory, at) VALUES ($1, $2, $3)"
                " ON CONFLICT (cluster) DO UPDATE SET inventory = EXCLUDED.inventory,"
                " at = EXCLUDED.at WHERE gateway.robot_fleets.at <= EXCLUDED.at",
                list(fleets.values()),
            )
        if latest:
            await conn.executemany(
                "INSERT INTO gateway.deployments (name, tenant, status, revision, at)"
                " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO UPDATE SET"
                " tenant = EXCLUDED.tenant, status = EXCLUDED.status,"
                " revision = EXCLUDED.revision, at = EXCLUDED.at"
                " WHERE gateway.deployments.at <= EXCLUDED.at",
                list(latest.values()),
            )
        if history:
            # One row per revision: the newest status of a revision tells its end.
            await conn.executemany(
                "INSERT INTO gateway.deployment_history (deployment, revision, phase, version,"
                " wave, waves, on_version, reason, at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8,"
                " $9) ON CONFLICT (deployment, revision) DO UPDATE SET phase = EXCLUDED.phase,"
                " wave = EXCLUDED.wave, waves = EXCLUDED.waves,"
                " on_version = EXCLUDED.on_version, reason = EXCLUDED.reason, at = EXCLUDED.at",
                history,
            )
            await conn.execute(
                "DELETE FROM gateway.deployment_history h USING (SELECT deployment, revision,"
                " row_number() OVER (PARTITION BY deployment ORDER BY revision DESC) AS n"
                " FROM gateway.deployment_history WHERE deployment = ANY($2::text[])) old"
                " WHERE h.deployment = old.deployment AND h.revision = old.revision"
                " AND old.n > $1",
                HISTORY_KEPT,
                sorted({h[0] for h in history}),
            )
    return dead


@router.get("/robots", response_model=RobotList)
async def list_robots(
    gw: GatewayDep,
    who: PrincipalDep,
    to: Annotated[str | None, Query(description="A selector: site=lab-a,robot_model=mk2")] = None,
) -> RobotList:
    """Every robot of every fleet (robots are the fleet's, not a tenant's)."""
    del who
    try:
        selector = RobotSelector.parse(to) if to else RobotSelector()
    except (ValueError, ValidationError) as exc:
        raise HTTPException(422, detail=f"selector: {exc}") from exc
    robots: list[RobotView] = []
    for row in await gw.pool.fetch("SELECT * FROM gateway.robot_fleets ORDER BY cluster"):
        inv = RobotInventory.model_validate_json(row["inventory"])
        robots += [
            RobotView(cluster=inv.cluster, **r.model_dump())
            for r in inv.robots
            if selector.matches(inv.cluster, r)
        ]
    return RobotList(robots=robots, online=sum(1 for r in robots if r.online), total=len(robots))


async def _row(gw: Gateway, name: str) -> asyncpg.Record | None:
    return await gw.pool.fetchrow("SELECT * FROM gateway.deployments WHERE name = $1", name)


@router.post("/deployments", status_code=202, response_model=Accepted)
async def declare_deployment(
    body: DeclareDeployment, gw: GatewayDep, who: PrincipalDep
) -> Accepted:
    """Deploy a model version to robots (a new version of a deployment rolls out in waves)."""
    tenant = body.tenant or who.tenant
    if not who.can_change(tenant):
        raise HTTPException(
            403,
            detail=f"a {who.role.value} token of tenant {who.tenant!r} cannot deploy for "
            f"tenant {tenant!r}",
        )
    spec = RobotDeploymentSpec.model_validate({**body.model_dump(), "tenant": tenant})
    row = await _row(gw, spec.name)
    if row is not None and row["tenant"] != tenant:
        raise HTTPException(409, detail=f"the deployment name {spec.name!r} is taken")
    if row is not None and json.loads(row["status"])["model"] != spec.model:
        raise HTTPException(
            409, detail=f"deployment {spec.name!r} deploys another model; pick another name"
        )
    other = await gw.pool.fetchval(
        "SELECT name FROM gateway.deployments WHERE status->>'model' = $1 AND name <> $2",
        spec.model,
        spec.name,
    )
    if other is not None:
        raise HTTPException(
            409,
            detail=f"model {spec.model} is deployed by deployment {other!r}: deploy its new "
            "versions there",
        )
    declared = DeploymentDeclared(spec=spec, declared_by=who.tenant)
    env = envelope_for("DeploymentDeclared", declared, producer="gateway", tenant=tenant)
    await publish_command(gw, OutMessage(topics.DEPLOYMENT_DECLARED, spec.name, env))
    return Accepted(
        deployment=spec.name,
        action="deploy",
        message=f"{spec.model}:{spec.version} to the robots selected, canary "
        f"{spec.canary_share:.0%} first; follow it with GET /v1/deployments/{spec.name}",
    )


@router.get("/deployments", response_model=DeploymentList)
async def list_deployments(gw: GatewayDep, who: PrincipalDep) -> DeploymentList:
    if who.sees_all:
        rows = await gw.pool.fetch("SELECT * FROM gateway.deployments ORDER BY name")
    else:
        rows = await gw.pool.fetch(
            "SELECT * FROM gateway.deployments WHERE tenant = $1 ORDER BY name", who.tenant
        )
    return DeploymentList(
        deployments=[
            DeploymentView(status=DeploymentStatus.model_validate_json(r["status"]), at=r["at"])
            for r in rows
        ]
    )


@router.get("/deployments/{name}", response_model=DeploymentView)
async def get_deployment(name: DeploymentName, gw: GatewayDep, who: PrincipalDep) -> DeploymentView:
    row = await _row(gw, name)
    if row is None or not who.can_read(row["tenant"]):
        raise HTTPException(404, detail=f"no deployment {name} visible to this token")
    history = await gw.pool.fetch(
        "SELECT * FROM gateway.deployment_history WHERE deployment = $1"
        " ORDER BY revision DESC LIMIT 50",
        name,
    )
    return DeploymentView(
        status=DeploymentStatus.model_validate_json(row["status"]),
        at=row["at"],
        history=[
            DeploymentHistory(
                revision=h["revision"],
                phase=h["phase"],
                version=h["version"],
                wave=h["wave"],
                waves=h["waves"],
                on_version=h["on_version"],
                reason=h["reason"],
                at=h["at"],
            )
            for h in history
        ],
    )


async def _command(
    gw: Gateway, who: Principal, name: str, action: DeploymentAction, **extra: Any
) -> Accepted:
    row = await _row(gw, name)
    if row is None or not who.can_read(row["tenant"]):
        raise HTTPException(404, detail=f"no deployment {name} visible to this token")
    if not who.can_change(row["tenant"]):
        raise HTTPException(403, detail=f"a {who.role.value} token cannot change deployments")
    try:
        command = DeploymentCommand(
            deployment=name, tenant=row["tenant"], action=action, requested_by=who.tenant, **extra
        )
    except ValidationError as exc:
        raise HTTPException(
            422,
            detail={"reason_code": "invalid_command", "message": describe_validation_error(exc)},
        ) from exc
    env = envelope_for("DeploymentCommand", command, producer="gateway", tenant=row["tenant"])
    await publish_command(gw, OutMessage(topics.DEPLOYMENT_COMMAND, name, env))
    return Accepted(deployment=name, action=action.value, message=f"{action.value} sent")


@router.post("/deployments/{name}/pin", status_code=202, response_model=Accepted)
async def pin_robot(
    name: DeploymentName, body: PinBody, gw: GatewayDep, who: PrincipalDep
) -> Accepted:
    if body.version is None:
        raise HTTPException(422, detail="pin needs the version the robot keeps")
    return await _command(
        gw, who, name, DeploymentAction.PIN, robot=body.robot, version=body.version
    )


@router.post("/deployments/{name}/unpin", status_code=202, response_model=Accepted)
async def unpin_robot(
    name: DeploymentName, body: PinBody, gw: GatewayDep, who: PrincipalDep
) -> Accepted:
    return await _command(gw, who, name, DeploymentAction.UNPIN, robot=body.robot)


@router.post("/deployments/{name}/{action}", status_code=202, response_model=Accepted)
async def deployment_action(
    name: DeploymentName, action: Name, gw: GatewayDep, who: PrincipalDep
) -> Accepted:
    allowed = {
        "pause": DeploymentAction.PAUSE,
        "resume": DeploymentAction.RESUME,
        "undo": DeploymentAction.UNDO,
    }
    if action not in allowed:
        raise HTTPException(404, detail=f"no deployment action {action!r}: pause, resume or undo")
    return await _command(gw, who, name, allowed[action])
