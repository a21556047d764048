"""The meter's PostgreSQL schema `meter`: ledger, runs, pools, budget counters. Batched:
every write takes a whole batch in one statement."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg

from services.common.db import migrate
from services.meter.pricing import Announced, Pool, PriceKey
from services.meter.runs import Phase, Placement, RunKey, RunState
from services.meter.ticks import Run, Share, Tick

SCHEMA = "meter"
MIGRATIONS = Path(__file__).parent / "migrations"

_TICK_COLUMNS = (
    ("tick_id", "text"),
    ("kind", "text"),
    ("run_id", "text"),
    ("job_id", "text"),
    ("attempt", "int"),
    ("tenant", "text"),
    ("project", "text"),
    ('"user"', "text"),
    ("cluster", "text"),
    ("accelerator_type", "text"),
    ("price_tier", "text"),
    ("count_u", "bigint"),
    ("interval_index", "bigint"),
    ("interval_start", "timestamptz"),
    ("interval_end", "timestamptz"),
    ("start_offset_u", "bigint"),
    ("end_offset_u", "bigint"),
    ("seconds_u", "bigint"),
    ("accelerator_seconds_u", "bigint"),
    ("unit_price_u", "bigint"),
    ("cost_u", "bigint"),
    ("outcome", "text"),
)
_COLUMN_NAMES = [c.strip('"') for c, _ in _TICK_COLUMNS]
# COPY encodes rows far faster than 22 unnest() arrays; a replay goes through a staging table
# and an INSERT that skips the ticks already in the ledger.
_STAGING = (
    "CREATE TEMP TABLE IF NOT EXISTS ledger_in (LIKE meter.ledger INCLUDING DEFAULTS) "
    "ON COMMIT DELETE ROWS"
)
_INSERT_STAGED = (
    f"INSERT INTO {SCHEMA}.ledger ({', '.join(c for c, _ in _TICK_COLUMNS)}) "
    f"SELECT {', '.join(c for c, _ in _TICK_COLUMNS)} FROM ledger_in "
    "ON CONFLICT (tick_id) DO NOTHING RETURNING tick_id"
)


async def migrate_meter(pool: asyncpg.Pool) -> list[str]:
    return await migrate(pool, SCHEMA, MIGRATIONS)


# --- ledger ------------------------------------------------------------------------------


async def insert_ticks(conn: asyncpg.Connection, ticks: Sequence[Tick]) -> list[Tick]:
    """Write ticks; return those not in the ledger before (a replay returns none). Must run
    inside a transaction.

    Ticks are nearly always new (the run state says what was billed), so they are COPYed
    straight in; only if that hits a tick already there (a replay after a crash) does it go
    through a staging table and an INSERT that skips the known ones.
    """
    if not ticks:
        return []
    records = list(ticks)  # a Tick is a tuple in column order (TickKind is a str)
    try:
        async with conn.transaction():  # a savepoint: a duplicate undoes only the COPY
            await conn.copy_records_to_table(
                "ledger", schema_name=SCHEMA, columns=_COLUMN_NAMES, records=records
            )
        return list(ticks)
    except asyncpg.UniqueViolationError:
        pass
    await conn.execute(_STAGING)
    await conn.copy_records_to_table("ledger_in", columns=_COLUMN_NAMES, records=records)
    fresh = {r["tick_id"] for r in await conn.fetch(_INSERT_STAGED)}
    return [t for t in ticks if t.tick_id in fresh]


async def add_interval_usage(
    conn: asyncpg.Connection, usage: dict[tuple[int, str, str, str, str], int]
) -> None:
    """usage: (interval, cluster, type, tier, tenant) -> accelerator-seconds (millionths)."""
    if not usage:
        return
    keys = sorted(usage)  # a stable lock order
    await conn.execute(
        "INSERT INTO meter.interval_usage AS u (interval_index, cluster, accelerator_type, "
        "price_tier, tenant, accelerator_seconds_u) SELECT * FROM unnest($1::bigint[], "
        "$2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[]) "
        "ON CONFLICT (interval_index, cluster, accelerator_type, price_tier, tenant) DO UPDATE "
        "SET accelerator_seconds_u = u.accelerator_seconds_u + EXCLUDED.accelerator_seconds_u",
        *([k[i] for k in keys] for i in range(5)),
        [usage[k] for k in keys],
    )


async def allocated(
    conn: asyncpg.Connection, first: int, last: int
) -> dict[int, dict[PriceKey, dict[str, int]]]:
    """Usage accelerator-seconds (millionths) per interval, pool and tenant, in first..last;
    the rows of those intervals (and any older) are then dropped: they are accounted."""
    rows = await conn.fetch(
        "SELECT interval_index, cluster, accelerator_type, price_tier, tenant, "
        "accelerator_seconds_u AS s FROM meter.interval_usage "
        "WHERE interval_index BETWEEN $1 AND $2",
        first,
        last,
    )
    await conn.execute("DELETE FROM meter.interval_usage WHERE interval_index <= $1", last)
    out: dict[int, dict[PriceKey, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        key = (r["cluster"], r["accelerator_type"], r["price_tier"])
        out[r["interval_index"]][key][r["tenant"]] = r["s"]
    return out


# --- runs --------------------------------------------------------------------------------


def _shares_json(shares: Iterable[Share]) -> list[list[Any]]:
    return [[s.price_tier, s.count_u, s.unit_price_u] for s in shares]


def _shares(raw: list[list[Any]]) -> tuple[Share, ...]:
    return tuple(Share(t, int(c), int(p)) for t, c, p in raw)


def _run_json(run: Run) -> str:
    return json.dumps(
        {
            "tenant": run.tenant,
            "project": run.project,
            "user": run.user,
            "cluster": run.cluster,
            "accelerator_type": run.accelerator_type,
            "shares": _shares_json(run.shares),
            "start_v": run.start_v,
        }
    )


def _placements_json(placements: Iterable[Placement]) -> str:
    return json.dumps(
        [
            {
                "epoch": p.epoch,
                "tenant": p.tenant,
                "project": p.project,
                "user": p.user,
                "cluster": p.cluster,
                "accelerator_type": p.accelerator_type,
                "nodes": list(p.nodes),
                "shares": _shares_json(p.shares),
            }
            for p in placements
        ]
    )


def _state(row: asyncpg.Record) -> RunState:
    run = None
    if row["run"] is not None:
        r = json.loads(row["run"])
        run = Run(
            row["job_id"],
            row["attempt"],
            r["tenant"],
            r["project"],
            r["user"],
            r["cluster"],
            r["accelerator_type"],
            _shares(r["shares"]),
            int(r["start_v"]),
            row["billed_u"] or 0,
        )
    placements = tuple(
        Placement(
            p["epoch"],
            p["tenant"],
            p["project"],
            p["user"],
            p["cluster"],
            p["accelerator_type"],
            tuple(p["nodes"]),
            _shares(p["shares"]),
        )
        for p in json.loads(row["placements"])
    )
    return RunState(
        row["job_id"],
        row["attempt"],
        Phase(row["phase"]),
        placements,
        row["started_at"],
        tuple(row["nodes"]),
        row["ran_u"],
        row["outcome"],
        run,
    )


_RUN_COLUMNS = (
    "job_id, attempt, phase, placements, started_at, nodes, ran_u, outcome, run, billed_u"
)


async def load_open(pool: asyncpg.Pool) -> list[RunState]:
    rows = await pool.fetch(f"SELECT {_RUN_COLUMNS} FROM meter.runs WHERE phase = 'open'")
    return [_state(r) for r in rows]


async def lock_runs(conn: asyncpg.Connection, keys: Iterable[RunKey]) -> dict[RunKey, RunState]:
    wanted = sorted(set(keys))  # a stable lock order
    if not wanted:
        return {}
    rows = await conn.fetch(
        f"SELECT {_RUN_COLUMNS} FROM meter.runs r JOIN unnest($1::text[], $2::int[]) "
        "AS k(j, a) ON r.job_id = k.j AND r.attempt = k.a ORDER BY r.job_id, r.attempt FOR UPDATE",
        [k[0] for k in wanted],
        [k[1] for k in wanted],
    )
    return {(r["job_id"], r["attempt"]): _state(r) for r in rows}


async def save_runs(conn: asyncpg.Connection, states: Sequence[RunState]) -> None:
    """Upsert these runs (distinct keys) in one statement: one plan for the batch, where a
    statement per row was planned afresh for each (plans are always custom, common/db.py).
    A run's nodes travel as a JSON array, since arrays of arrays cannot be ragged."""
    if not states:
        return
    rows = sorted(states, key=lambda s: s.key)  # the order its FOR UPDATE read locked them in
    await conn.execute(
        f"INSERT INTO meter.runs ({_RUN_COLUMNS}, updated_at) "
        "SELECT u.j, u.a, u.ph, u.pl, u.st, ARRAY(SELECT jsonb_array_elements_text(u.n)), "
        "u.ran, u.oc, u.r, u.b, now() "
        "FROM unnest($1::text[], $2::int[], $3::text[], $4::jsonb[], $5::timestamptz[], "
        "$6::jsonb[], $7::bigint[], $8::text[], $9::jsonb[], $10::bigint[]) "
        "AS u(j, a, ph, pl, st, n, ran, oc, r, b) "
        "ON CONFLICT (job_id, attempt) DO UPDATE SET phase = EXCLUDED.phase, "
        "placements = EXCLUDED.placements, started_at = EXCLUDED.started_at, "
        "nodes = EXCLUDED.nodes, ran_u = EXCLUDED.ran_u, outcome = EXCLUDED.outcome, "
        "run = EXCLUDED.run, billed_u = EXCLUDED.billed_u, updated_at = now()",
        [s.job_id for s in rows],
        [s.attempt for s in rows],
        [s.phase.value for s in rows],
        [_placements_json(s.placements) for s in rows],
        [s.started_at for s in rows],
        [json.dumps(list(s.nodes)) for s in rows],
        [s.ran_u for s in rows],
        [s.outcome for s in rows],
        [_run_json(s.run) if s.run else None for s in rows],
        [s.run.billed_u if s.run else None for s in rows],
    )


async def save_billed(conn: asyncpg.Connection, states: Sequence[RunState]) -> None:
    """The clock moved on: only how far each open run is billed changed."""
    runs = [s.run for s in states if s.run is not None]
    if runs:
        await conn.execute(
            "UPDATE meter.runs AS r SET billed_u = u.b, updated_at = now() "
            "FROM unnest($1::text[], $2::int[], $3::bigint[]) AS u(j, a, b) "
            "WHERE r.job_id = u.j AND r.attempt = u.a",
            [r.job_id for r in runs],
            [r.attempt for r in runs],
            [r.billed_u for r in runs],
        )


# --- pools and idle accounting -------------------------------------------------------------


async def save_pools(conn: asyncpg.Connection, by_cluster: dict[str, list[Pool]]) -> None:
    """Replace each listed cluster's inventory (a capacity event is the whole cluster)."""
    for cluster, pools in by_cluster.items():
        await conn.execute("DELETE FROM meter.pools WHERE cluster = $1", cluster)
        await conn.executemany(
            "INSERT INTO meter.pools (cluster, accelerator_type, price_tier, accelerators, "
            "unit_price_u) VALUES ($1, $2, $3, $4, $5)",
            [
                (p.cluster, p.accelerator_type, p.price_tier, p.accelerators, p.unit_price_u)
                for p in pools
            ],
        )


async def save_announced(conn: asyncpg.Connection, by_cluster: dict[str, Announced]) -> None:
    """Keep what each listed cluster's newest inventory said about prices (one row a
    cluster; an inventory that says what the last one did writes nothing)."""
    if not by_cluster:
        return
    docs = [(cluster, a.to_json()) for cluster, a in sorted(by_cluster.items())]
    await conn.execute(
        "INSERT INTO meter.announced AS a (cluster, prices, tiers)"
        " SELECT * FROM unnest($1::text[], $2::jsonb[], $3::jsonb[])"
        " ON CONFLICT (cluster) DO UPDATE SET prices = EXCLUDED.prices, tiers = EXCLUDED.tiers"
        " WHERE (a.prices, a.tiers) IS DISTINCT FROM (EXCLUDED.prices, EXCLUDED.tiers)",
        [c for c, _ in docs],
        [json.dumps(d["prices"]) for _, d in docs],
        [json.dumps(d["tiers"]) for _, d in docs],
    )


async def load_announced(pool: asyncpg.Pool) -> dict[str, Announced]:
    rows = await pool.fetch("SELECT cluster, prices, tiers FROM meter.announced")
    return {
        r["cluster"]: Announced.from_json(
            {"prices": json.loads(r["prices"]), "tiers": json.loads(r["tiers"])}
        )
        for r in rows
    }


async def load_pools(pool: asyncpg.Pool) -> list[Pool]:
    rows = await pool.fetch(
        "SELECT cluster, accelerator_type, price_tier, accelerators, unit_price_u FROM meter.pools"
    )
    return [Pool(**dict(r)) for r in rows]


async def idle_through(conn: asyncpg.Connection | asyncpg.Pool) -> int | None:
    value = await conn.fetchval("SELECT idle_through FROM meter.meter_state WHERE id = 1")
    return None if value is None else int(value)


async def set_idle_through(conn: asyncpg.Connection, index: int) -> None:
    await conn.execute(
        "INSERT INTO meter.meter_state (id, idle_through) VALUES (1, $1) "
        "ON CONFLICT (id) DO UPDATE SET idle_through = EXCLUDED.idle_through",
        index,
    )


# --- budgets -------------------------------------------------------------------------------


async def add_budget_usage(
    conn: asyncpg.Connection, deltas: dict[tuple[str, str, str], tuple[int, int]]
) -> None:
    """deltas: (tenant, project, month) -> (accelerator-seconds, cost) to add, millionths."""
    if not deltas:
        return
    keys = sorted(deltas)  # a stable lock order
    await conn.execute(
        "INSERT INTO meter.budget_usage AS b "
        "(tenant, project, month, accelerator_seconds_u, cost_u) "
        "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[]) "
        "ON CONFLICT (tenant, project, month) DO UPDATE SET "
        "accelerator_seconds_u = b.accelerator_seconds_u + EXCLUDED.accelerator_seconds_u, "
        "cost_u = b.cost_u + EXCLUDED.cost_u",
        [k[0] for k in keys],
        [k[1] for k in keys],
        [k[2] for k in keys],
        [deltas[k][0] for k in keys],
        [deltas[k][1] for k in keys],
    )


async def budget_totals(
    conn: asyncpg.Connection, tenants: Iterable[str], month: str
) -> dict[tuple[str, str], tuple[int, int]]:
    rows = await conn.fetch(
        "SELECT tenant, project, accelerator_seconds_u, cost_u FROM meter.budget_usage "
        "WHERE month = $1 AND tenant = ANY($2::text[])",
        month,
        sorted(set(tenants)),
    )
    return {(r["tenant"], r["project"]): (r["accelerator_seconds_u"], r["cost_u"]) for r in rows}


async def claim_thresholds(
    conn: asyncpg.Connection, rows: Sequence[tuple[str, str, Decimal, Decimal]]
) -> set[tuple[str, str, Decimal]]:
    """rows: (budget id, month, threshold, used). Returns those not announced before."""
    if not rows:
        return set()
    got = await conn.fetch(
        "INSERT INTO meter.budget_alerts (budget_id, month, threshold, used) "
        "SELECT * FROM unnest($1::text[], $2::text[], $3::numeric[], $4::numeric[]) "
        "ON CONFLICT DO NOTHING RETURNING budget_id, month, threshold",
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        [r[3] for r in rows],
    )
    return {(r["budget_id"], r["month"], r["threshold"]) for r in got}
