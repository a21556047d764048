"""Each tenant's queue as `GET /v1/queues` answers it: quota, usage, borrowing and lending per
accelerator type (services/gateway/shares.py says how each is computed), pending work by the
scheduler's reason, fair share against actual share, queue wait and preemptions.

All from the gateway's read model: gateway.jobs (state, type, accelerators), gateway.explanations
(the scheduler's latest reason codes per pending job) and gateway.job_events (queue wait,
preemptions) over a time window.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
from pydantic import BaseModel

from schemas.job import JobState
from services.gateway.auth import Principal, Role
from services.gateway.context import Gateway
from services.gateway.projection import HOLDING
from services.gateway.shares import Load, standings

# The code of a queued job the scheduler has not explained yet (as `qm explain` says).
AWAITING_CYCLE = "awaiting_cycle"
ACTIVE = sorted({JobState.SUBMITTED.value, JobState.QUEUED.value} | {s.value for s in HOLDING})
ENDED = sorted(s.value for s in JobState if s.terminal)


class TypeQueue(BaseModel):
    accelerator_type: str  # a type; `A100|H100` or `any` for pending jobs accepting several
    nominal: float | None  # None: no quota applies
    usage: float
    borrowed: float
    lent: float
    pending_jobs: int
    pending_accelerators: float


class ReasonCount(BaseModel):
    code: str  # the first of the job's reason codes (the scheduler's main reason)
    jobs: int
    accelerators: float


class WaitStats(BaseModel):
    """Queued -> started, per start in the window (a requeued job waits again)."""

    starts: int
    p50_s: float | None = None
    p90_s: float | None = None
    p99_s: float | None = None
    max_s: float | None = None


class OldestPending(BaseModel):
    job_id: str | None  # None: a job the caller may not read (finance sees every queue)
    submitted_at: datetime
    waiting_s: float
    codes: list[str]


class TenantQueue(BaseModel):
    tenant: str
    weight: float
    cohort: str | None
    usage: float  # accelerators held, any type
    fair_share: float | None  # of the fleet's demand, by weight; None without demand
    actual_share: float  # of all accelerators held
    types: list[TypeQueue]
    pending_jobs: int
    pending_accelerators: float
    pending_by_reason: list[ReasonCount]
    jobs_by_state: dict[str, int]  # active jobs, and jobs submitted in the window that ended
    wait: WaitStats
    preemptions_received: int  # its runs stopped to make room for another job
    preemptions_given: int  # runs stopped to make room for its jobs
    oldest_pending: OldestPending | None = None


class QueuesView(BaseModel):
    tenants: list[TenantQueue]
    window_s: float
    since: datetime
    at: datetime


def sees_every_tenant(who: Principal) -> bool:
    return who.sees_all or who.role is Role.FINANCE


async def queues_view(gw: Gateway, who: Principal, *, hours: float = 24.0) -> QueuesView:
    """Every tenant's queue for admin, ops and finance; a researcher's own tenant only."""
    now = datetime.now(UTC)
    since = now - timedelta(hours=hours)
    scope = None if sees_every_tenant(who) else [who.tenant]
    loads: dict[str, Load] = {}
    held = await gw.pool.fetch(
        "SELECT tenant, COALESCE(accelerator_type, 'any') AS t, sum(accelerators) AS n"
        " FROM gateway.jobs WHERE state = ANY($1::text[]) AND accelerators > 0"
        " GROUP BY 1, 2",
        sorted(s.value for s in HOLDING),
    )
    for r in held:
        loads.setdefault(r["tenant"], Load()).usage[r["t"]] = float(r["n"])
    pending = await gw.pool.fetch(
        "SELECT j.tenant, COALESCE(j.accelerator_type, 'any') AS t,"
        f" COALESCE(e.codes[1], '{AWAITING_CYCLE}') AS code, count(*) AS jobs,"
        " COALESCE(sum(j.accelerators), 0) AS n FROM gateway.jobs j"
        " LEFT JOIN gateway.explanations e USING (job_id) WHERE j.state = 'queued'"
        " GROUP BY 1, 2, 3",
    )
    for r in pending:
        p = loads.setdefault(r["tenant"], Load()).pending
        p[r["t"]] = p.get(r["t"], 0.0) + float(r["n"])
    fleet_types = [
        r["accelerator_type"]
        for r in await gw.pool.fetch("SELECT DISTINCT accelerator_type FROM gateway.fleet_nodes")
    ]
    ranked = standings(gw.policy, loads, scope, fleet_types)
    names = [s.tenant for s in ranked]
    states = await _jobs_by_state(gw, names, since)
    waits = await _waits(gw, names, since)
    received, given = await _preemptions(gw, names, since)
    oldest = await _oldest(gw, names, now, who)
    tenants = []
    for s in ranked:
        rows = [r for r in pending if r["tenant"] == s.tenant]
        tenants.append(
            TenantQueue(
                tenant=s.tenant,
                weight=s.weight,
                cohort=s.cohort,
                usage=s.usage,
                fair_share=s.fair_share,
                actual_share=s.actual_share,
                types=[
                    TypeQueue(
                        accelerator_type=t.accelerator_type,
                        nominal=t.nominal,
                        usage=t.usage,
                        borrowed=t.borrowed,
                        lent=t.lent,
                        pending_jobs=sum(r["jobs"] for r in rows if r["t"] == t.accelerator_type),
                        pending_accelerators=sum(
                            float(r["n"]) for r in rows if r["t"] == t.accelerator_type
                        ),
                    )
                    for t in s.types
                ],
                pending_jobs=sum(r["jobs"] for r in rows),
                pending_accelerators=sum(float(r["n"]) for r in rows),
                pending_by_reason=_by_reason(rows),
                jobs_by_state=states.get(s.tenant, {}),
                wait=waits.get(s.tenant, WaitStats(starts=0)),
                preemptions_received=received.get(s.tenant, 0),
                preemptions_given=given.get(s.tenant, 0),
                oldest_pending=oldest.get(s.tenant),
            )
        )
    return QueuesView(tenants=tenants, window_s=hours * 3600, since=since, at=now)


def _by_reason(rows: list[asyncpg.Record]) -> list[ReasonCount]:
    jobs: dict[str, int] = {}
    accelerators: dict[str, float] = {}
    for r in rows:
        code = r["code"]
        jobs[code] = jobs.get(code, 0) + r["jobs"]
        accelerators[code] = accelerators.get(code, 0.0) + float(r["n"])
    return [
        ReasonCount(code=c, jobs=jobs[c], accelerators=accelerators[c])
        for c in sorted(jobs, key=lambda c: (-jobs[c], c))
    ]


async def _jobs_by_state(
    gw: Gateway, tenants: list[str], since: datetime
) -> dict[str, dict[str, int]]:
    rows = await gw.pool.fetch(
        "SELECT tenant, state, count(*) AS n FROM gateway.jobs WHERE tenant = ANY($1::text[])"
        " AND (state = ANY($2::text[]) OR (state = ANY($3::text[]) AND submitted_at >= $4))"
        " GROUP BY 1, 2",
        tenants,
        ACTIVE,
        ENDED,
        since,
    )
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        out.setdefault(r["tenant"], {})[r["state"]] = r["n"]
    return out


async def _waits(gw: Gateway, tenants: list[str], since: datetime) -> dict[str, WaitStats]:
    # Each start in the window against the newest queueing of that job before it.
    rows = await gw.pool.fetch(
        "SELECT j.tenant, count(*) AS starts,"
        " percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY w.s) AS p,"
        " max(w.s) AS top FROM ("
        "  SELECT s.job_id, extract(epoch FROM s.at - q.at)::float8 AS s"
        "  FROM gateway.job_events s CROSS JOIN LATERAL (SELECT max(e.at) AS at"
        "   FROM gateway.job_events e WHERE e.job_id = s.job_id AND e.type = 'JobQueued'"
        "   AND e.at <= s.at) q"
        "  WHERE s.type = 'JobStarted' AND s.at >= $2 AND q.at IS NOT NULL) w"
        " JOIN gateway.jobs j USING (job_id) WHERE j.tenant = ANY($1::text[]) GROUP BY 1",
        tenants,
        since,
    )
    return {
        r["tenant"]: WaitStats(
            starts=r["starts"], p50_s=r["p"][0], p90_s=r["p"][1], p99_s=r["p"][2], max_s=r["top"]
        )
        for r in rows
    }


async def _preemptions(
    gw: Gateway, tenants: list[str], since: datetime
) -> tuple[dict[str, int], dict[str, int]]:
    """Runs ended for another job's claim (JobPreempted naming `for_job`) in the window: by the
    victim's tenant (received) and by the tenant of the job it made room for (given)."""
    received = await gw.pool.fetch(
        "SELECT j.tenant, count(*) AS n FROM gateway.job_events e JOIN gateway.jobs j"
        " USING (job_id) WHERE e.type = 'JobPreempted' AND e.at >= $2"
        " AND e.for_job IS NOT NULL AND j.tenant = ANY($1::text[]) GROUP BY 1",
        tenants,
        since,
    )
    given = await gw.pool.fetch(
        "SELECT j.tenant, count(*) AS n FROM gateway.job_events e JOIN gateway.jobs j"
        " ON j.job_id = e.for_job WHERE e.type = 'JobPreempted' AND e.at >= $2"
        " AND j.tenant = ANY($1::text[]) GROUP BY 1",
        tenants,
        since,
    )
    return {r["tenant"]: r["n"] for r in received}, {r["tenant"]: r["n"] for r in given}


async def _oldest(
    gw: Gateway, tenants: list[str], now: datetime, who: Principal
) -> dict[str, OldestPending]:
    rows = await gw.pool.fetch(
        "SELECT DISTINCT ON (j.tenant) j.tenant, j.job_id, j.submitted_at, e.codes"
        " FROM gateway.jobs j LEFT JOIN gateway.explanations e USING (job_id)"
        " WHERE j.state = 'queued' AND j.tenant = ANY($1::text[])"
        " ORDER BY j.tenant, j.submitted_at, j.job_id",
        tenants,
    )
    return {
        r["tenant"]: OldestPending(
            job_id=r["job_id"] if who.can_read(r["tenant"]) else None,
            submitted_at=r["submitted_at"],
            waiting_s=max(0.0, (now - r["submitted_at"]).total_seconds()),
            codes=list(r["codes"] or [AWAITING_CYCLE]),
        )
        for r in rows
    }
