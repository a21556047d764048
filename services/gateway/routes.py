"""The REST API: submit, status, list, cancel and the live event stream of a job."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from schemas import topics
from schemas.events import JobCancelRequested
from schemas.ids import new_id
from schemas.job import JobSpec, JobState
from schemas.validation import describe_validation_error
from services.common.admission import check_admission
from services.common.kafka import OutMessage, envelope_for, publish_all
from services.gateway import store
from services.gateway.api_models import (
    CancelAccepted,
    HistoryItem,
    JobList,
    JobStatus,
    JobSummary,
    Problem,
    SubmitJob,
    Submitted,
)
from services.gateway.auth import Principal, Role
from services.gateway.context import Gateway
from services.gateway.deps import gateway, principal
from services.gateway.problems import BODY_ANSWERS
from services.gateway.projection import EventLine, submitted_view
from services.gateway.watch import event_stream

router = APIRouter(prefix="/v1")


GatewayDep = Annotated[Gateway, Depends(gateway)]
PrincipalDep = Annotated[Principal, Depends(principal)]


def _not_found(job_id: str) -> HTTPException:
    # Another tenant's job is reported exactly like a missing one: ids leak nothing.
    return HTTPException(404, detail=f"no job {job_id} visible to this token")


@router.post(
    "/jobs",
    status_code=202,
    response_model=Submitted,
    responses={
        **BODY_ANSWERS,
        422: {"model": Problem, "description": BODY_ANSWERS[422]["description"]},
        403: {"description": "The token may not submit for this tenant."},
        200: {"model": Submitted, "description": "A retry: the job this key already made."},
    },
)
async def submit_job(
    body: SubmitJob, gw: GatewayDep, who: PrincipalDep, response: Response
) -> Submitted:
    tenant = body.tenant or who.tenant
    if who.role is not Role.ADMIN and (who.role is not Role.USER or tenant != who.tenant):
        raise HTTPException(
            403,
            detail=f"a {who.role.value} token of tenant {who.tenant!r} "
            f"cannot submit jobs for tenant {tenant!r}",
        )
    job_id = new_id()
    try:
        spec = JobSpec.model_validate(
            {**body.model_dump(exclude_none=True), "tenant": tenant, "job_id": job_id}
        )
    except ValidationError as exc:
        raise HTTPException(
            422, detail={"reason_code": "invalid_spec", "message": describe_validation_error(exc)}
        ) from exc
    rejection = check_admission(spec, gw.policy)
    if rejection is not None:
        raise HTTPException(
            422, detail={"reason_code": rejection.reason.value, "message": rejection.message}
        )
    if gw.tracing is None:
        return await _submit(gw, spec, job_id, tenant, None, response)
    # A job's trace starts here (docs/tracing.md); its first span ends once the broker has it.
    with gw.tracing.started("gateway.submit", job_id=job_id, tenant=tenant) as traceparent:
        return await _submit(gw, spec, job_id, tenant, traceparent, response)


async def _submit(
    gw: Gateway,
    spec: JobSpec,
    job_id: str,
    tenant: str,
    traceparent: str | None,
    response: Response,
) -> Submitted:
    env = envelope_for("JobSubmitted", spec, producer="gateway", tenant=tenant)
    env.traceparent = traceparent
    line = EventLine(
        env.event_id,
        job_id,
        env.occurred_at,
        env.type,
        JobState.SUBMITTED,
        None,
        f"submitted by {spec.user} to queue {spec.queue}",
    )
    view = submitted_view(spec, job_id, env.occurred_at)
    existing = await store.insert_submitted(gw.pool, view, line)
    if existing is not None:
        row = await store.get_job(gw.pool, existing)
        response.status_code = 200
        return Submitted(
            job_id=existing, state=row["state"] if row else "submitted", duplicate=True
        )
    try:
        await publish_all(gw.broker, [OutMessage(topics.JOB_SUBMITTED, job_id, env)])
    except Exception as exc:
        # Nothing was submitted: forget the read-model row so the id does not linger.
        await store.forget(gw.pool, job_id)
        raise HTTPException(503, detail="the job log is unavailable; retry shortly") from exc
    return Submitted(job_id=job_id, state=JobState.SUBMITTED.value)


@router.get("/jobs/{job_id}", response_model=JobStatus)
async def job_status(job_id: str, gw: GatewayDep, who: PrincipalDep) -> JobStatus:
    row = await store.get_job(gw.pool, job_id)
    if row is None or not who.can_read(row["tenant"]):
        raise _not_found(job_id)
    lines = await store.history(gw.pool, job_id, who.can_read)
    return JobStatus(
        **{
            k: row[k]
            for k in (
                "job_id",
                "tenant",
                "project",
                "user",
                "queue",
                "name",
                "state",
                "reason_code",
                "message",
                "cluster",
                "replicas",
                "accelerators",
                "submitted_at",
                "updated_at",
            )
        },
        nodes=list(row["nodes"] or []),
        spec=json.loads(row["spec"]) if row["spec"] else None,
        history=[HistoryItem(**r) for r in lines],
    )


@router.get("/jobs", response_model=JobList)
async def list_jobs(
    gw: GatewayDep,
    who: PrincipalDep,
    state: Annotated[JobState | None, Query()] = None,
    queue: Annotated[str | None, Query()] = None,
    tenant: Annotated[str | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> JobList:
    if not who.sees_all:
        if tenant is not None and tenant != who.tenant:
            raise HTTPException(403, detail=f"this token may only list tenant {who.tenant!r}")
        tenant = who.tenant
    rows = await store.list_jobs(
        gw.pool, tenant=tenant, state=state.value if state else None, queue=queue, limit=limit
    )
    return JobList(jobs=[JobSummary(**dict(r)) for r in rows])


@router.delete(
    "/jobs/{job_id}",
    status_code=202,
    response_model=CancelAccepted,
    responses={
        404: {"description": "No such job visible to this token."},
        403: {"description": "The token may read but not change this job."},
        409: {"description": "The job has already ended."},
        503: BODY_ANSWERS[503],
    },
)
async def cancel_job(job_id: str, gw: GatewayDep, who: PrincipalDep) -> CancelAccepted:
    await request_cancel(gw, who, job_id)
    return CancelAccepted(job_id=job_id)


async def request_cancel(gw: Gateway, who: Principal, job_id: str, via: str = "api") -> None:
    """Ask for a job to be cancelled, as `who`; raises the HTTP answer when it may not be."""
    row = await store.get_job(gw.pool, job_id)
    if row is None or not who.can_read(row["tenant"]):
        raise _not_found(job_id)
    if not who.can_change(row["tenant"]):
        raise HTTPException(403, detail=f"a {who.role.value} token cannot cancel jobs")
    if JobState(row["state"]).terminal:
        raise HTTPException(409, detail=f"job {job_id} already {row['state']}")
    by = f"{who.tenant}/{who.role.value}" + ("" if via == "api" else f" via the {via}")
    cmd = JobCancelRequested(job_id=job_id, requested_by=by)
    env = envelope_for("JobCancelRequested", cmd, producer="gateway", tenant=row["tenant"])
    await publish_all(gw.broker, [OutMessage(topics.JOB_CANCEL_REQUESTED, job_id, env)])


@router.get("/jobs/{job_id}/events")
async def job_events(
    job_id: str, gw: GatewayDep, who: PrincipalDep, follow: bool = False
) -> Response:
    row = await store.get_job(gw.pool, job_id)
    if row is None or not who.can_read(row["tenant"]):
        raise _not_found(job_id)
    if not follow:
        lines = await store.history(gw.pool, job_id, who.can_read)
        return Response(
            json.dumps([HistoryItem(**r).model_dump(mode="json") for r in lines]),
            media_type="application/json",
        )
    return StreamingResponse(
        event_stream(gw, job_id, who.can_read),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
