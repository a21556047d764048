"""The dashboard's pages: server-rendered HTML from the gateway's read model, with the same
tokens, roles and tenant scoping as the REST API (a researcher sees their own tenant; ops and
admin see every tenant; finance sees every tenant's cost)."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import math
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import generate_latest

from schemas.job import JobState
from services.common import scrape
from services.common.budgetfile import Budget, ConfigError, parse_budgets
from services.common.policyfile import read_yaml
from services.gateway import fleet, queues, store, usage
from services.gateway.auth import Role
from services.gateway.context import Gateway
from services.gateway.dashboard import live, queries
from services.gateway.dashboard.queries import BadQuery, JobQuery
from services.gateway.dashboard.render import STATIC, environment
from services.gateway.dashboard.session import COOKIE, Sessions, Viewer
from services.gateway.explain import explanation
from services.gateway.routes import request_cancel

router = APIRouter(prefix="/ui", include_in_schema=False)
ENV = environment()
MAX_BULK = 500

NAV = (
    ("overview", "/ui/", "Overview"),
    ("jobs", "/ui/jobs", "Jobs"),
    ("tenants", "/ui/tenants", "Tenants & queues"),
    ("fleet", "/ui/fleet", "Fleet"),
    ("cost", "/ui/cost", "Cost"),
    ("scheduler", "/ui/scheduler", "Scheduler health"),
)


class SignIn(Exception):
    """No session: the page sends the person to sign in, then back."""

    def __init__(self, next_url: str) -> None:
        self.next_url = next_url


def install(app: FastAPI, sessions: Sessions) -> None:
    app.state.sessions = sessions
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
    app.include_router(router)

    async def sign_in(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, SignIn)
        target = "/ui/login?" + urlencode({"next": exc.next_url})
        if request.headers.get("hx-request"):
            return Response(status_code=401, headers={"HX-Redirect": target})
        return RedirectResponse(target, status_code=303)

    app.add_exception_handler(SignIn, sign_in)


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway  # type: ignore[no-any-return]


def viewer(request: Request) -> Viewer:
    sessions: Sessions = request.app.state.sessions
    seen = sessions.viewer(request)
    if seen is None:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise SignIn(path)
    return seen


def scope(who: Viewer) -> str | None:
    """The one tenant a viewer's job views are limited to, or None for every tenant."""
    return None if who.principal.sees_all else who.tenant


def cost_scope(who: Viewer) -> str | None:
    return None if who.principal.role in usage.USAGE_READERS else who.tenant


def page(request: Request, who: Viewer, template: str, active: str, **ctx: Any) -> HTMLResponse:
    html = ENV.get_template(template).render(
        request=request, viewer=who, nav=NAV, active=active, now=datetime.now(UTC), **ctx
    )
    return HTMLResponse(html, headers={"Cache-Control": "no-store"})


def problem(request: Request, who: Viewer, status: int, message: str) -> HTMLResponse:
    answer = page(request, who, "problem.html", "", status=status, message=message)
    answer.status_code = status
    return answer


def _safe_next(raw: str | None) -> str:
    # Only a path of this dashboard: never an absolute URL (an open redirect).
    if raw and raw.startswith("/ui") and not raw.startswith("//"):
        return raw
    return "/ui/"


# --- signing in ---------------------------------------------------------------------------


@router.get("/login")
async def login_form(request: Request, next: str | None = None) -> HTMLResponse:
    html = ENV.get_template("login.html").render(next=_safe_next(next), error=None)
    return HTMLResponse(html)


async def _form(request: Request) -> dict[str, list[str]]:
    body = (await request.body()).decode("utf-8", errors="replace")
    try:
        return parse_qs(body, keep_blank_values=True, max_num_fields=MAX_BULK + 10)
    except ValueError:
        raise HTTPException(400, detail=f"at most {MAX_BULK} jobs at a time") from None


@router.post("/login")
async def login(request: Request) -> Response:
    try:
        form = await _form(request)
    except HTTPException:
        form = {}
    token = (form.get("token") or [""])[0].strip()
    target = _safe_next((form.get("next") or [""])[0])
    sessions: Sessions = request.app.state.sessions
    cookie = sessions.issue(token) if token else None
    if cookie is None:
        html = ENV.get_template("login.html").render(
            next=target, error="That token is not known here. Check it and try again."
        )
        return HTMLResponse(html, status_code=401)
    answer = RedirectResponse(target, status_code=303)
    answer.set_cookie(
        COOKIE,
        cookie,
        max_age=sessions.ttl_s,
        httponly=True,
        samesite="strict",
        secure=_gw(request).settings.ui_secure_cookie,
        path="/ui",
    )
    return answer


@router.post("/logout")
async def logout(request: Request) -> Response:
    who = viewer(request)
    form = await _form(request)
    request.app.state.sessions.check_csrf(request, who, (form.get("csrf") or [""])[0])
    answer = RedirectResponse("/ui/login", status_code=303)
    answer.delete_cookie(COOKIE, path="/ui")
    return answer


# --- overview ------------------------------------------------------------------------------


@router.get("/")
async def overview(request: Request) -> HTMLResponse:
    who = viewer(request)
    gw = _gw(request)
    tenant = scope(who)
    now = datetime.now(UTC)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    # Independent reads, each on its own pooled connection: PostgreSQL works on one while
    # the gateway reads another's answer.
    by_state, wait, oldest, (xs, series), spend, fleet = await asyncio.gather(
        queries.jobs_by_state(gw.pool, tenant),
        queries.queue_wait(gw.pool, tenant, now - timedelta(hours=24)),
        queries.oldest_pending(gw.pool, tenant),
        queries.allocated_over_time(gw.pool, tenant, now - timedelta(hours=6)),
        queries.spend_by_tenant(gw.pool, cost_scope(who), month),
        _fleet_totals(gw, who),
    )
    budgets = budget_lines(gw, spend, cost_scope(who))
    return page(
        request,
        who,
        "overview.html",
        "overview",
        by_state=by_state,
        states=[s.value for s in JobState],
        pending=sum(by_state.get(s, 0) for s in queries.PENDING),
        wait=wait,
        oldest=oldest,
        chart={"x": xs, "series": series},
        budgets=budgets,
        fleet=fleet,
    )


async def _fleet_totals(gw: Gateway, who: Viewer) -> list[dict[str, Any]]:
    """Accelerators by type from the fleet read model."""
    view = await fleet.fleet_view(gw, who.principal, cells=False)
    return [t.model_dump() for t in view.totals]


def load_budgets(gw: Gateway) -> tuple[Budget, ...]:
    try:
        return parse_budgets(read_yaml(gw.settings.budgets_file).get("budgets") or [])
    except (OSError, ConfigError, AttributeError):
        return ()


def budget_lines(
    gw: Gateway, spend: dict[tuple[str, str | None], dict[str, float]], tenant: str | None
) -> list[dict[str, Any]]:
    lines = []
    for b in load_budgets(gw):
        if tenant is not None and b.tenant != tenant:
            continue
        used = spend.get((b.tenant, b.project), {"hours": 0.0, "cost": 0.0})
        amount = used["hours"] if b.unit.value == "accelerator_hours" else used["cost"]
        ratio = amount / float(b.limit)
        crossed = [float(t) for t in b.thresholds if ratio * 100 >= float(t)]
        lines.append(
            {
                "id": b.budget_id,
                "tenant": b.tenant,
                "project": b.project,
                "unit": b.unit.value,
                "limit": float(b.limit),
                "used": amount,
                "ratio": ratio,
                "thresholds": [float(t) for t in b.thresholds],
                "crossed": crossed,
                "enforcement": b.enforcement.value,
            }
        )
    return lines


# --- jobs ---------------------------------------------------------------------------------


def _query(request: Request, who: Viewer) -> JobQuery:
    return JobQuery.parse(dict(request.query_params), scope(who))


@router.get("/jobs")
async def jobs(request: Request) -> HTMLResponse:
    who = viewer(request)
    gw = _gw(request)
    try:
        q = _query(request, who)
    except BadQuery as exc:
        return problem(request, who, 400, str(exc))
    now = datetime.now(UTC)
    if q.group:
        rows = await queries.groups(gw.pool, q)
        return page(request, who, "groups.html", "jobs", q=q, groups=rows, filters=_choices(q))
    result = await queries.jobs_page(gw.pool, q, now)
    ids = ",".join(r["job_id"] for r in result.rows)
    live_params = urlencode({**q.params(after=None, before=None), "ids": ids})
    return page(
        request,
        who,
        "jobs.html",
        "jobs",
        q=q,
        rows=result.rows,
        next_cursor=result.next_cursor,
        prev_cursor=result.prev_cursor,
        live_url=f"/ui/live/jobs?{live_params}",
        filters=_choices(q),
        can_cancel=who.principal.role in (Role.ADMIN, Role.USER),
        audit=await queries.audit_trail(gw.pool, scope(who), 10),
    )


def _choices(q: JobQuery) -> dict[str, Any]:
    return {
        "columns": list(queries.COLUMNS),
        "values": {k: ",".join(v) for k, v in q.filters.items()},
        "states": [*queries.STATE_SETS, *(s.value for s in JobState)],
        "sorts": queries.SORTS,
        "sizes": queries.PAGE_SIZES,
    }


CSV_COLUMNS = (
    "job_id",
    "name",
    "tenant",
    "project",
    "user",
    "queue",
    "state",
    "accelerator_type",
    "accelerators",
    "replicas",
    "cluster",
    "attempt",
    "preemptions",
    "wait_s",
    "cost",
    "reason_code",
    "submitted_at",
    "updated_at",
)


def csv_cell(value: Any) -> Any:
    """A value as a spreadsheet may safely open it: text that a spreadsheet would run as a
    formula (a job named `=HYPERLINK(...)` by a careless or hostile user) gets a leading `'`."""
    if value is None:
        return ""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


@router.get("/jobs.csv")
async def jobs_csv(request: Request) -> Response:
    who = viewer(request)
    gw = _gw(request)
    try:
        q = _query(request, who)
    except BadQuery as exc:
        raise HTTPException(400, detail=str(exc)) from exc

    async def lines() -> AsyncIterator[str]:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CSV_COLUMNS)
        async for row in queries.csv_rows(gw.pool, q):
            writer.writerow([csv_cell(row.get(c)) for c in CSV_COLUMNS])
            if out.tell() > 64_000:
                yield out.getvalue()
                out.seek(0)
                out.truncate()
        yield out.getvalue()

    return StreamingResponse(
        lines(),
        media_type="text/csv",
        headers={"Content-Disposition": 'attachment; filename="jobs.csv"'},
    )


@router.post("/jobs/cancel")
async def bulk_cancel(request: Request) -> HTMLResponse:
    who = viewer(request)
    gw = _gw(request)
    form = await _form(request)
    request.app.state.sessions.check_csrf(request, who, (form.get("csrf") or [""])[0])
    ids = list(dict.fromkeys(form.get("job_id", [])))[:MAX_BULK]
    actor = f"{who.tenant}/{who.role} via the dashboard"
    results = []
    for job_id in ids:
        try:
            await request_cancel(gw, who.principal, job_id, via="dashboard")
            outcome = "requested"
        except HTTPException as exc:
            outcome = str(exc.detail)
        if outcome == "requested" or not outcome.startswith("no job"):
            await queries.audit(gw.pool, actor, "cancel", job_id, outcome)
        results.append({"job_id": job_id, "outcome": outcome})
    html = ENV.get_template("_cancel_result.html").render(results=results)
    return HTMLResponse(html)


@router.get("/jobs/{job_id}")
async def job_detail(request: Request, job_id: str) -> HTMLResponse:
    who = viewer(request)
    gw = _gw(request)
    row = await store.get_job(gw.pool, job_id)
    if row is None or not who.principal.can_read(row["tenant"]):
        return problem(request, who, 404, f"No job {job_id} visible to you.")
    lines = await store.history(gw.pool, job_id, who.principal.can_read)
    why = await explanation(gw, row)
    state = JobState(row["state"])
    position = (
        await queries.pending_position(gw.pool, row)
        if state in (JobState.SUBMITTED, JobState.QUEUED)
        else None
    )
    costs = await queries.job_costs(gw.pool, job_id)
    placement = await gw.pool.fetchval(
        "SELECT placement FROM gateway.jobs WHERE job_id = $1", job_id
    )
    spec = json.loads(row["spec"]) if row["spec"] else None
    audit_rows = await gw.pool.fetch(
        "SELECT at, actor, action, outcome FROM gateway.audit WHERE job_id = $1 ORDER BY id",
        job_id,
    )
    return page(
        request,
        who,
        "job.html",
        "jobs",
        job=dict(row),
        lines=lines,
        why=why,
        position=position,
        costs=costs,
        placement=json.loads(placement) if isinstance(placement, str) else placement,
        spec=json.dumps(spec, indent=2) if spec else "",
        audit=[dict(r) for r in audit_rows],
        can_cancel=who.principal.can_change(row["tenant"]) and not state.terminal,
    )


# --- tenants and fleet ---------------------------------------------------------------------


@router.get("/tenants")
async def tenants(request: Request) -> HTMLResponse:
    who = viewer(request)
    view = await queues.queues_view(_gw(request), who.principal)
    return page(request, who, "tenants.html", "tenants", view=view)


@router.get("/fleet")
async def fleet_page(
    request: Request, cluster: str | None = None, type: str | None = None
) -> HTMLResponse:
    who = viewer(request)
    view = await fleet.fleet_view(
        _gw(request), who.principal, cluster=cluster or None, accelerator_type=type or None
    )
    return page(request, who, "fleet.html", "fleet", fleet=view, cluster=cluster, type=type)


@router.get("/fleet/nodes/{node_id}")
async def node_page(request: Request, node_id: str) -> HTMLResponse:
    who = viewer(request)
    detail = await fleet.node_detail(_gw(request), who.principal, node_id)
    if detail is None:
        return problem(request, who, 404, f"No node {node_id} in any cluster's inventory.")
    return page(request, who, "node.html", "fleet", d=detail)


# --- cost ---------------------------------------------------------------------------------


@router.get("/cost")
async def cost(request: Request, by: str = "tenant", window: str = "month") -> HTMLResponse:
    who = viewer(request)
    gw = _gw(request)
    if by not in queries.COST_DIMENSIONS or window not in queries.WINDOWS:
        return problem(
            request,
            who,
            400,
            f"by must be one of {', '.join(queries.COST_DIMENSIONS)}; "
            f"window one of {', '.join(queries.WINDOWS)}",
        )
    now = datetime.now(UTC)
    since = now - queries.WINDOWS[window]
    tenant = cost_scope(who)
    rows, idle = await queries.cost_table(gw.pool, by, tenant, since)
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    spend = await queries.spend_by_tenant(gw.pool, tenant, month)
    return page(
        request,
        who,
        "cost.html",
        "cost",
        by=by,
        window=window,
        rows=rows,
        idle=idle if tenant is None else None,
        budgets=budget_lines(gw, spend, tenant),
        dimensions=list(queries.COST_DIMENSIONS),
        windows=list(queries.WINDOWS),
        total=sum(float(r["cost"] or 0) for r in rows),
    )


@router.get("/cost.csv")
async def cost_csv(request: Request, by: str = "tenant", window: str = "month") -> Response:
    who = viewer(request)
    gw = _gw(request)
    if by not in queries.COST_DIMENSIONS or window not in queries.WINDOWS:
        raise HTTPException(400, detail="unknown dimension or window")
    since = datetime.now(UTC) - queries.WINDOWS[window]
    rows, _ = await queries.cost_table(gw.pool, by, cost_scope(who), since)
    return Response(
        usage.as_csv(rows, ["key", "currency", "hours", "cost", "ticks"]),
        media_type="text/csv",
        headers={"Content-Disposition": f'attachment; filename="cost-by-{by}.csv"'},
    )


# --- scheduler health ---------------------------------------------------------------------


SCRAPE_TTL_S = 5.0  # open scheduler pages share one scrape of the services this long


async def _scraped(request: Request, gw: Gateway) -> list[scrape.Target]:
    """The services' metrics, scraped at most once per SCRAPE_TTL_S however many pages ask
    (each scrape makes every service render its /metrics on its event loop)."""
    state = request.app.state
    if getattr(state, "scrape_lock", None) is None:
        state.scrape_lock = asyncio.Lock()
        state.scraped = (0.0, [])
    async with state.scrape_lock:
        at, targets = state.scraped
        if time.monotonic() - at >= SCRAPE_TTL_S:
            targets = await scrape.scrape(
                scrape.parse_targets(gw.settings.metrics_targets),
                getattr(state, "scrape_client", None),  # the app's, kept (scrape_client)
            )
            state.scraped = (time.monotonic(), targets)
    return list(targets)


@router.get("/scheduler")
async def scheduler_health(request: Request) -> HTMLResponse:
    who = viewer(request)
    gw = _gw(request)
    targets = list(await _scraped(request, gw))
    runtime = request.app.state.runtime
    own = scrape.Target("gateway", "(this process)")
    own.samples = scrape.parse_metrics(generate_latest(runtime.registry).decode())
    targets.insert(0, own)
    leaders = [t for t in targets if t.total("qm_scheduler_is_leader") >= 1]
    sched = leaders[0] if leaders else None
    cycle = scrape.histogram(sched, "qm_scheduler_cycle_seconds") if sched else None
    publish = scrape.histogram(sched, "qm_scheduler_publish_seconds") if sched else None
    services = []
    for t in targets:
        groups = sorted(
            {g for s in t.values("qm_consumer_batch_seconds_count") if (g := s.labels.get("group"))}
        )
        services.append(
            {
                "name": t.name,
                "error": t.error,
                "groups": [
                    {
                        "group": g,
                        "batch": scrape.histogram(t, "qm_consumer_batch_seconds", group=g),
                        "lag": t.total("qm_consumer_lag_records", group=g)
                        if t.values("qm_consumer_lag_records", group=g)
                        else None,
                        "dead": t.total("qm_consumer_dead_letters_total", group=g),
                        "stalled": t.total("qm_consumer_stalled_seconds", group=g),
                    }
                    for g in groups
                ],
            }
        )
    # The read model's counts are scoped like every other view: a researcher's own tenant.
    tenant = scope(who)
    pending = await gw.pool.fetch(
        "SELECT code, count(*) AS n FROM gateway.explanations x"
        " JOIN gateway.jobs j USING (job_id), unnest(x.codes) AS code"
        " WHERE j.state = ANY($1::text[]) AND ($2::text IS NULL OR j.tenant = $2)"
        " GROUP BY code ORDER BY n DESC",
        list(queries.PENDING),
        tenant,
    )
    preemptions = await gw.pool.fetch(
        "SELECT coalesce(e.reason_code, 'unknown') AS reason, count(*) AS n"
        " FROM gateway.job_events e JOIN gateway.jobs j USING (job_id)"
        " WHERE e.type = 'JobPreempted' AND e.at > now() - interval '24 hours'"
        " AND ($1::text IS NULL OR j.tenant = $1) GROUP BY 1 ORDER BY n DESC",
        tenant,
    )
    return page(
        request,
        who,
        "scheduler.html",
        "scheduler",
        sched=sched,
        cycle=cycle,
        publish=publish,
        placed=sched.total("qm_scheduler_placements_total") if sched else None,
        cycles=cycle["count"] if cycle else None,
        pending_jobs=sched.total("qm_scheduler_pending_jobs") if sched else None,
        services=services,
        pending=[dict(r) for r in pending],
        preemptions=[dict(r) for r in preemptions],
        targets_configured=len(targets) > 1,
    )


# --- live ---------------------------------------------------------------------------------


@router.get("/live/jobs")
async def live_jobs(request: Request) -> Response:
    who = viewer(request)
    try:
        q = _query(request, who)
    except BadQuery as exc:
        raise HTTPException(400, detail=str(exc)) from exc
    shown = [i for i in request.query_params.get("ids", "").split(",") if i][:200]
    stream = live.jobs_stream(_gw(request), request, q, shown, ENV)
    return live.sse_response(stream)


@router.get("/live/changes")
async def live_changes(request: Request, every: float | None = None) -> Response:
    who = viewer(request)
    every_s = None if every is None or not math.isfinite(every) else min(max(every, 1.0), 300.0)
    return live.sse_response(live.changes_stream(_gw(request), request, scope(who), every_s))


@router.get("/live/job/{job_id}")
async def live_job(request: Request, job_id: str) -> Response:
    who = viewer(request)
    gw = _gw(request)
    row = await store.get_job(gw.pool, job_id)
    if row is None or not who.principal.can_read(row["tenant"]):
        raise HTTPException(404, detail=f"no job {job_id} visible to you")
    since = request.query_params.get("seen", "")
    stream = live.job_stream(gw, request, job_id, set(since.split(",")), ENV, who)
    return live.sse_response(stream)
