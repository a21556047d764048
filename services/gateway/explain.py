"""Why a job is where it is: the scheduler's explanation while it waits, its state otherwise."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import asyncpg
from aiokafka import ConsumerRecord
from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel

from schemas import topics
from schemas.events import PendingExplained
from schemas.job import JobState
from services.common.deadletter import decode_payloads
from services.common.kafka import OutMessage
from services.gateway import store
from services.gateway.auth import Principal
from services.gateway.context import Gateway
from services.gateway.deps import gateway, principal
from services.gateway.pools import growing_for

router = APIRouter(prefix="/v1")


class Explanation(BaseModel):
    job_id: str
    state: str
    codes: list[str]
    message: str
    pending_jobs: int | None = None
    at: datetime | None = None
    # A pool the autoscaler is growing for this job (while it waits for capacity).
    growing: dict[str, Any] | None = None


async def record_explanations(
    pool: asyncpg.Pool, records: tuple[ConsumerRecord[Any, Any], ...]
) -> list[OutMessage]:
    """Keep the newest explanation per job (replays and reordering cannot roll it back);
    returns dead letters for what is not an explanation."""
    received, dead = decode_payloads(
        records, {topics.SCHEDULING_EXPLAINED: PendingExplained}, consumer="gateway"
    )
    newest: dict[str, tuple[PendingExplained, datetime]] = {}
    for got, p in received:
        at = got.envelope.occurred_at
        if p.job_id not in newest or newest[p.job_id][1] <= at:
            newest[p.job_id] = (p, at)
    if newest:
        # One statement for the batch (one plan; a statement per row was planned afresh for
        # each, common/db.py). The codes travel as a JSON array: arrays of arrays cannot be
        # ragged.
        rows = [newest[job_id] for job_id in sorted(newest)]
        await pool.execute(
            "INSERT INTO gateway.explanations (job_id, codes, message, pending_jobs, at)"
            " SELECT u.j, ARRAY(SELECT jsonb_array_elements_text(u.c)), u.m, u.n, u.a"
            " FROM unnest($1::text[], $2::jsonb[], $3::text[], $4::int[], $5::timestamptz[])"
            " AS u(j, c, m, n, a)"
            " ON CONFLICT (job_id) DO UPDATE SET"
            " codes = EXCLUDED.codes, message = EXCLUDED.message,"
            " pending_jobs = EXCLUDED.pending_jobs, at = EXCLUDED.at"
            " WHERE gateway.explanations.at <= EXCLUDED.at",
            [p.job_id for p, _ in rows],
            [json.dumps(p.codes) for p, _ in rows],
            [p.message for p, _ in rows],
            [p.pending_jobs for p, _ in rows],
            [at for _, at in rows],
        )
    return dead


@router.get("/jobs/{job_id}/explain", response_model=Explanation)
async def explain_job(
    job_id: str, gw: Gateway = Depends(gateway), who: Principal = Depends(principal)
) -> Explanation:
    row = await store.get_job(gw.pool, job_id)
    if row is None or not who.can_read(row["tenant"]):
        raise HTTPException(404, detail=f"no job {job_id} visible to this token")
    return await explanation(gw, row)


async def explanation(gw: Gateway, row: asyncpg.Record) -> Explanation:
    """Why the job of this read-model row is where it is (`qm explain` and the dashboard)."""
    job_id = row["job_id"]
    state = JobState(row["state"])
    if state in (JobState.SUBMITTED, JobState.QUEUED):
        why = await gw.pool.fetchrow(
            "SELECT codes, message, pending_jobs, at FROM gateway.explanations WHERE job_id = $1",
            job_id,
        )
        growing = await growing_for(gw.pool, job_id)
        if growing is not None:
            growing["message"] = (
                f"pool {growing['pool']} of {growing['cluster']} is growing to "
                f"{growing['desired_nodes']} node(s) for it"
            )
        if why is None:
            return Explanation(
                job_id=job_id,
                state=state.value,
                codes=["awaiting_cycle"],
                message="Waiting for the scheduler's next cycle to consider it.",
                growing=growing,
            )
        return Explanation(job_id=job_id, state=state.value, growing=growing, **dict(why))
    if state.terminal:
        code = row["reason_code"] or state.value
        return Explanation(
            job_id=job_id,
            state=state.value,
            codes=[code],
            message=row["message"] or f"The job {state.value}.",
        )
    nodes = ", ".join(row["nodes"] or [])
    return Explanation(
        job_id=job_id,
        state=state.value,
        codes=[state.value],
        message=f"{state.value.capitalize()} on {row['cluster']}: {nodes}.",
    )
