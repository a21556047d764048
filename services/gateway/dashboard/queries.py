"""The dashboard's reads of the gateway's read model: filtered, grouped and keyset-paged in
PostgreSQL, so a page costs the same with ten jobs or a million.

Every filter, group and sort name is looked up in a whitelist; user text only ever reaches
PostgreSQL as a bound parameter.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from schemas.job import JobState

# filter/group name -> column of gateway.jobs
COLUMNS: dict[str, str] = {
    "tenant": "tenant",
    "project": "project",
    "user": '"user"',
    "queue": "queue",
    "state": "state",
    "type": "accelerator_type",
    "cluster": "cluster",
}
PENDING = ("submitted", "queued")
HOLDING = ("placed", "running", "preempting")
ACTIVE = (*PENDING, *HOLDING)
TERMINAL = tuple(s.value for s in JobState if s.terminal)
# state filter shorthands
STATE_SETS: dict[str, tuple[str, ...]] = {
    "pending": PENDING,
    "holding": HOLDING,
    "active": ACTIVE,
    "ended": TERMINAL,
}
SORTS = ("newest", "oldest")
PAGE_SIZES = (25, 50, 100, 200)
CSV_MAX_ROWS = 100_000

ROW_COLUMNS = (
    'job_id, name, tenant, project, "user", queue, state, accelerator_type, accelerators,'
    " replicas, cluster, attempt, reason_code, message, submitted_at, updated_at"
)


class BadQuery(ValueError):
    """A filter, group, sort or cursor the dashboard does not know; the message says which."""


@dataclass(frozen=True)
class JobQuery:
    filters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    group: str | None = None
    sort: str = "newest"
    limit: int = 50
    after: str | None = None  # cursor of the last row of the previous page
    before: str | None = None  # cursor of the first row of the next page (going back)

    @classmethod
    def parse(cls, params: Mapping[str, str], scope_tenant: str | None) -> JobQuery:
        """From a page's URL parameters; `scope_tenant` is forced for callers who see one
        tenant (asking for another is refused, not silently widened)."""
        filters: dict[str, tuple[str, ...]] = {}
        for name in COLUMNS:
            raw = params.get(name, "").strip()
            if not raw:
                continue
            values = tuple(dict.fromkeys(v.strip() for v in raw.split(",") if v.strip()))
            if name == "state":
                values = _states(values)
            filters[name] = values
        if scope_tenant is not None:
            asked = filters.get("tenant")
            if asked and set(asked) != {scope_tenant}:
                raise BadQuery(f"this session may only see tenant {scope_tenant!r}")
            filters["tenant"] = (scope_tenant,)
        group = params.get("group") or None
        if group is not None and group not in COLUMNS:
            raise BadQuery(f"cannot group by {group!r}; choose from {', '.join(COLUMNS)}")
        sort = params.get("sort") or "newest"
        if sort not in SORTS:
            raise BadQuery(f"sort must be one of {', '.join(SORTS)}")
        try:
            limit = int(params.get("limit") or 50)
        except ValueError:
            raise BadQuery("limit must be a number") from None
        if limit not in PAGE_SIZES:
            raise BadQuery(f"limit must be one of {', '.join(map(str, PAGE_SIZES))}")
        after, before = params.get("after") or None, params.get("before") or None
        for cursor in (after, before):
            if cursor is not None:
                decode_cursor(cursor)  # refuse a mangled one now, with a clear message
        return cls(filters, group, sort, limit, after, before)

    def params(self, **changes: Any) -> dict[str, str]:
        """URL parameters of this query with some changed (None drops one)."""
        out = {k: ",".join(v) for k, v in self.filters.items()}
        out |= {"group": self.group or "", "sort": self.sort, "limit": str(self.limit)}
        out |= {"after": self.after or "", "before": self.before or ""}
        for k, v in changes.items():
            out[k] = "" if v is None else str(v)
        return {k: v for k, v in out.items() if v and not (k == "sort" and v == "newest")}


def _states(values: tuple[str, ...]) -> tuple[str, ...]:
    known = {s.value for s in JobState}
    out: list[str] = []
    for v in values:
        if v in STATE_SETS:
            out += STATE_SETS[v]
        elif v in known:
            out.append(v)
        else:
            names = sorted(known | set(STATE_SETS))
            raise BadQuery(f"unknown state {v!r}; choose from {', '.join(names)}")
    return tuple(dict.fromkeys(out))


def encode_cursor(at: datetime, job_id: str) -> str:
    raw = f"{at.astimezone(UTC).isoformat()}|{job_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        at, _, job_id = raw.partition("|")
        when = datetime.fromisoformat(at)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise BadQuery("this page link is damaged; start from the first page") from None
    if not job_id or when.tzinfo is None:
        raise BadQuery("this page link is damaged; start from the first page")
    return when, job_id


def where(query: JobQuery, args: list[Any], alias: str = "") -> list[str]:
    """WHERE terms for the query's filters, binding values into args."""
    terms = []
    for name, values in query.filters.items():
        args.append(list(values))
        terms.append(f"{alias}{COLUMNS[name]} = ANY(${len(args)}::text[])")
    return terms


@dataclass(frozen=True)
class JobPage:
    rows: list[dict[str, Any]]
    next_cursor: str | None  # for "older" (or "newer" when sorted oldest first)
    prev_cursor: str | None


async def jobs_page(pool: asyncpg.Pool, query: JobQuery, now: datetime) -> JobPage:
    """One page of jobs in the query's order, with the per-row figures computed for that
    page only (wait, preemptions, cost so far)."""
    args: list[Any] = []
    terms = where(query, args)
    descending = query.sort == "newest"
    backwards = query.before is not None and query.after is None
    cursor = query.before if backwards else query.after
    if cursor is not None:
        at, job_id = decode_cursor(cursor)
        args += [at, job_id]
        # rows after the cursor in the direction the page is read
        older = descending != backwards
        terms.append(
            f"(submitted_at, job_id) {'<' if older else '>'} (${len(args) - 1}, ${len(args)})"
        )
    scan_desc = descending != backwards
    order = "DESC" if scan_desc else "ASC"
    args.append(query.limit + 1)
    clause = f"WHERE {' AND '.join(terms)}" if terms else ""
    sql = (
        f"SELECT page.*,"
        " (SELECT min(e.at) FROM gateway.job_events e"
        "   WHERE e.job_id = page.job_id AND e.type = 'JobStarted') AS started_at,"
        " (SELECT count(*) FROM gateway.job_events e"
        "   WHERE e.job_id = page.job_id AND e.type = 'JobPreempted') AS preemptions,"
        " (SELECT sum(u.cost) FROM gateway.usage_ticks u WHERE u.job_id = page.job_id) AS cost"
        f" FROM (SELECT {ROW_COLUMNS} FROM gateway.jobs {clause}"
        f"  ORDER BY submitted_at {order}, job_id {order} LIMIT ${len(args)}) page"
        f" ORDER BY submitted_at {order}, job_id {order}"
    )
    fetched = [dict(r) for r in await pool.fetch(sql, *args)]
    more = len(fetched) > query.limit
    rows = fetched[: query.limit]
    if backwards:
        rows.reverse()
    for row in rows:
        decorate(row, now)
    if not rows:
        return JobPage([], None, None)
    first, last = rows[0], rows[-1]
    has_next = more if not backwards else True
    has_prev = (query.after is not None) if not backwards else more
    return JobPage(
        rows,
        encode_cursor(last["submitted_at"], last["job_id"]) if has_next else None,
        encode_cursor(first["submitted_at"], first["job_id"]) if has_prev else None,
    )


def decorate(row: dict[str, Any], now: datetime) -> None:
    """Add the figures a person reads off a row: wait so far (or until it started)."""
    started = row.get("started_at")
    if started is not None:
        row["wait_s"] = max(0.0, (started - row["submitted_at"]).total_seconds())
    elif row["state"] in PENDING:
        row["wait_s"] = max(0.0, (now - row["submitted_at"]).total_seconds())
    else:
        row["wait_s"] = None


async def rows_by_id(
    pool: asyncpg.Pool, query: JobQuery, job_ids: Sequence[str]
) -> list[dict[str, Any]]:
    """The rows of these jobs that the query's filters let through (for live updates)."""
    if not job_ids:
        return []
    args: list[Any] = [list(job_ids)]
    terms = ["job_id = ANY($1::text[])", *where(query, args)]
    sql = (
        f"SELECT page.*,"
        " (SELECT min(e.at) FROM gateway.job_events e"
        "   WHERE e.job_id = page.job_id AND e.type = 'JobStarted') AS started_at,"
        " (SELECT count(*) FROM gateway.job_events e"
        "   WHERE e.job_id = page.job_id AND e.type = 'JobPreempted') AS preemptions,"
        " (SELECT sum(u.cost) FROM gateway.usage_ticks u WHERE u.job_id = page.job_id) AS cost"
        f" FROM (SELECT {ROW_COLUMNS} FROM gateway.jobs WHERE {' AND '.join(terms)}) page"
    )
    rows = [dict(r) for r in await pool.fetch(sql, *args)]
    now = datetime.now(UTC)
    for row in rows:
        decorate(row, now)
    return rows


async def csv_rows(pool: asyncpg.Pool, query: JobQuery) -> Any:
    """Every row the query matches, in its order, a thousand at a time (for CSV export)."""
    sent = 0
    page_query = JobQuery(query.filters, None, query.sort, 200)
    cursor = None
    now = datetime.now(UTC)
    while sent < CSV_MAX_ROWS:
        page = await jobs_page(
            pool, JobQuery(page_query.filters, None, query.sort, 200, cursor), now
        )
        for row in page.rows:
            yield row
        sent += len(page.rows)
        if page.next_cursor is None:
            return
        cursor = page.next_cursor


async def groups(pool: asyncpg.Pool, query: JobQuery, limit: int = 500) -> list[dict[str, Any]]:
    """Jobs grouped by one column: counts by state family, accelerators held, the oldest
    pending, biggest groups first."""
    assert query.group is not None
    column = COLUMNS[query.group]
    args: list[Any] = []
    terms = where(query, args)
    clause = f"WHERE {' AND '.join(terms)}" if terms else ""
    args += [list(PENDING), list(HOLDING), limit]
    p, h, lim = len(args) - 2, len(args) - 1, len(args)
    sql = (
        f"SELECT {column} AS key, count(*) AS jobs,"
        f" count(*) FILTER (WHERE state = ANY(${p}::text[])) AS pending,"
        f" count(*) FILTER (WHERE state = ANY(${h}::text[])) AS holding,"
        " count(*) FILTER (WHERE state = 'succeeded') AS succeeded,"
        " count(*) FILTER (WHERE state IN ('failed', 'rejected')) AS failed,"
        f" coalesce(sum(accelerators) FILTER (WHERE state = ANY(${h}::text[])), 0) AS allocated,"
        f" min(submitted_at) FILTER (WHERE state = ANY(${p}::text[])) AS oldest_pending"
        f" FROM gateway.jobs {clause} GROUP BY 1 ORDER BY jobs DESC, key LIMIT ${lim}"
    )
    return [dict(r) for r in await pool.fetch(sql, *args)]


# --- overview ------------------------------------------------------------------------------


def _tenant_term(tenant: str | None, args: list[Any], column: str = "tenant") -> str:
    if tenant is None:
        return "TRUE"
    args.append(tenant)
    return f"{column} = ${len(args)}"


async def jobs_by_state(pool: asyncpg.Pool, tenant: str | None) -> dict[str, int]:
    args: list[Any] = []
    term = _tenant_term(tenant, args)
    rows = await pool.fetch(
        f"SELECT state, count(*) AS n FROM gateway.jobs WHERE {term} GROUP BY state", *args
    )
    return {r["state"]: r["n"] for r in rows}


async def queue_wait(
    pool: asyncpg.Pool, tenant: str | None, since: datetime
) -> dict[str, float | int | None]:
    """p50/p95 of submit -> first start for jobs that first started since `since`.

    Only the window's starts are read (the partial index on starts by time); each one's job
    and first start are looked up by job id (a restart is not a wait). The lateral `LIMIT 1`
    and the scalar subquery keep those lookups per row: as plain joins the planner hashes the
    whole jobs table and every earlier start, and the cost grows with the history (400,000
    jobs over 60 days: 1.0 s for a 24-hour window that way, 92 ms this way)."""
    args: list[Any] = [since]
    term = _tenant_term(tenant, args, "j.tenant")
    row = await pool.fetchrow(
        "SELECT count(*) AS n,"
        " percentile_cont(0.5) WITHIN GROUP (ORDER BY w) AS p50,"
        " percentile_cont(0.95) WITHIN GROUP (ORDER BY w) AS p95"
        " FROM (SELECT extract(epoch FROM s.at - j.submitted_at) AS w"
        "  FROM (SELECT job_id, min(at) AS at FROM gateway.job_events"
        "   WHERE type = 'JobStarted' AND at >= $1 GROUP BY job_id) s"
        "  CROSS JOIN LATERAL (SELECT tenant, submitted_at FROM gateway.jobs"
        "   WHERE job_id = s.job_id LIMIT 1) j"
        f"  WHERE {term} AND (SELECT min(p.at) FROM gateway.job_events p"
        "   WHERE p.job_id = s.job_id AND p.type = 'JobStarted') >= $1) starts",
        *args,
    )
    return {"n": row["n"], "p50": row["p50"], "p95": row["p95"]}


async def oldest_pending(pool: asyncpg.Pool, tenant: str | None) -> dict[str, Any] | None:
    args: list[Any] = [list(PENDING)]
    term = _tenant_term(tenant, args)
    row = await pool.fetchrow(
        "SELECT job_id, tenant, name, queue, submitted_at FROM gateway.jobs"
        f" WHERE state = ANY($1::text[]) AND {term} ORDER BY submitted_at LIMIT 1",
        *args,
    )
    return dict(row) if row else None


async def allocated_over_time(
    pool: asyncpg.Pool, tenant: str | None, since: datetime, buckets: int = 48
) -> tuple[list[float], dict[str, list[float]]]:
    """Accelerators held per tenant over time, from usage ticks: accelerator-seconds of the
    intervals that start in each bucket over the bucket's length (x: bucket starts, epoch s)."""
    now = datetime.now(UTC)
    step = max((now - since).total_seconds() / buckets, 1.0)
    args: list[Any] = [since, step]
    term = _tenant_term(tenant, args)
    rows = await pool.fetch(
        "SELECT tenant, floor(extract(epoch FROM interval_start - $1) / $2)::int AS b,"
        " sum(accelerator_seconds) AS acc_s FROM gateway.usage_ticks"
        f" WHERE interval_start >= $1 AND kind <> 'idle' AND {term} GROUP BY 1, 2",
        *args,
    )
    xs = [since.timestamp() + i * step for i in range(buckets)]
    series: dict[str, list[float]] = {}
    for r in rows:
        if 0 <= r["b"] < buckets:
            line = series.setdefault(r["tenant"], [0.0] * buckets)
            line[r["b"]] += float(r["acc_s"]) / step
    return xs, dict(sorted(series.items()))


async def spend_by_tenant(
    pool: asyncpg.Pool, tenant: str | None, month_start: datetime
) -> dict[tuple[str, str | None], dict[str, float]]:
    """This month's accelerator-hours and cost per (tenant, project) and per tenant (project
    None), usage only (idle capacity apart)."""
    args: list[Any] = [month_start]
    term = _tenant_term(tenant, args)
    rows = await pool.fetch(
        "SELECT tenant, project, sum(accelerator_seconds) / 3600 AS hours, sum(cost) AS cost"
        " FROM gateway.usage_ticks WHERE interval_start >= $1 AND kind <> 'idle'"
        f" AND {term} GROUP BY GROUPING SETS ((tenant, project), (tenant))",
        *args,
    )
    return {
        (r["tenant"], r["project"]): {
            "hours": float(r["hours"] or 0),
            "cost": float(r["cost"] or 0),
        }
        for r in rows
    }


COST_DIMENSIONS = {
    "tenant": "tenant",
    "project": "project",
    "user": '"user"',
    "cluster": "cluster",
    "type": "accelerator_type",
    "tier": "price_tier",
}
WINDOWS = {"day": timedelta(days=1), "week": timedelta(days=7), "month": timedelta(days=30)}


async def cost_table(
    pool: asyncpg.Pool, by: str, tenant: str | None, since: datetime
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Usage cost grouped by one dimension since `since`, and idle cost apart."""
    column = COST_DIMENSIONS[by]
    args: list[Any] = [since]
    term = _tenant_term(tenant, args)
    rows = await pool.fetch(
        f"SELECT {column} AS key, currency, sum(accelerator_seconds) / 3600 AS hours,"
        " sum(cost) AS cost, count(*) AS ticks FROM gateway.usage_ticks"
        f" WHERE interval_start >= $1 AND kind <> 'idle' AND {term}"
        " GROUP BY 1, 2 ORDER BY cost DESC, key",
        *args,
    )
    idle = await pool.fetchrow(
        "SELECT coalesce(sum(accelerator_seconds), 0) / 3600 AS hours,"
        " coalesce(sum(cost), 0) AS cost FROM gateway.usage_ticks"
        " WHERE interval_start >= $1 AND kind = 'idle'",
        since,
    )
    return [dict(r) for r in rows], {"hours": float(idle["hours"]), "cost": float(idle["cost"])}


# --- one job ------------------------------------------------------------------------------


async def job_costs(pool: asyncpg.Pool, job_id: str) -> dict[str, Any]:
    """Cost so far of one job and its rate over its newest metering interval."""
    total = await pool.fetchrow(
        "SELECT coalesce(sum(cost), 0) AS cost, coalesce(sum(accelerator_seconds), 0) AS acc_s,"
        " max(currency) AS currency FROM gateway.usage_ticks WHERE job_id = $1",
        job_id,
    )
    last = await pool.fetchrow(
        "SELECT cost, seconds, interval_start FROM gateway.usage_ticks WHERE job_id = $1"
        " AND seconds > 0 ORDER BY interval_start DESC LIMIT 1",
        job_id,
    )
    rate = float(last["cost"]) / float(last["seconds"]) * 3600 if last else None
    return {
        "cost": float(total["cost"]),
        "hours": float(total["acc_s"]) / 3600,
        "currency": total["currency"] or "",
        "rate_per_hour": rate,
    }


async def pending_position(pool: asyncpg.Pool, row: Mapping[str, Any]) -> dict[str, int]:
    """Where a pending job stands by arrival: jobs of its tenant and of everyone submitted
    before it that still wait. (The scheduler's order also weighs priority and fair share;
    its own word is the explanation.)"""
    found = await pool.fetchrow(
        "SELECT count(*) FILTER (WHERE tenant = $2) AS in_tenant, count(*) AS in_all"
        " FROM gateway.jobs WHERE state = ANY($3::text[]) AND (submitted_at, job_id) < ($1, $4)",
        row["submitted_at"],
        row["tenant"],
        list(PENDING),
        row["job_id"],
    )
    return {"tenant": found["in_tenant"] + 1, "all": found["in_all"] + 1}


async def audit(pool: asyncpg.Pool, actor: str, action: str, job_id: str, outcome: str) -> None:
    await pool.execute(
        "INSERT INTO gateway.audit (actor, action, job_id, outcome) VALUES ($1, $2, $3, $4)",
        actor,
        action,
        job_id,
        outcome,
    )


async def audit_trail(
    pool: asyncpg.Pool, tenant: str | None, limit: int = 50
) -> list[dict[str, Any]]:
    args: list[Any] = [limit]
    term = "TRUE" if tenant is None else "j.tenant = $2"
    if tenant is not None:
        args.append(tenant)
    rows = await pool.fetch(
        "SELECT a.at, a.actor, a.action, a.job_id, a.outcome FROM gateway.audit a"
        f" LEFT JOIN gateway.jobs j USING (job_id) WHERE {term} ORDER BY a.id DESC LIMIT $1",
        *args,
    )
    return [dict(r) for r in rows]
