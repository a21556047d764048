"""What a phase of a bench cost in units of work, not seconds: PostgreSQL transactions and row
writes (`pg_stat_database` of the stack's database, and per table `pg_stat_user_tables`) and,
per consumer group, batches and records (each service's `/metrics`). Divided by the jobs of
the phase, these tell whether a change in CPU per job came from doing more of something (more,
smaller batches; more transactions; more rows) or from each unit costing more.

PostgreSQL's counters are approximate at a phase's edges: a backend reports its counts at the
end of a transaction at most once a second (and an idle one within ten), so up to about a
second of each busy backend's work can fall into the next reading.

WAL (`pg_stat_wal`: records, full-page images, bytes) is the whole server's, not the
database's: on a server other work shares, its figures hold that work too. A row written
costs a heap record (COPY: one per page of rows), one record per index it enters (an update
that is not HOT enters every index again), a lock record where it was locked first (`FOR
UPDATE`, `ON CONFLICT DO UPDATE`) and another where an update's new version goes to another
page; an `ON CONFLICT` insert adds a confirmation. So WAL records per job, beside row writes
and HOT updates per job, tell how much each row write cost PostgreSQL.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import asyncpg
import httpx

from services.common.scrape import parse_metrics

PG_COLUMNS = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_deleted")
WAL_COLUMNS = ("wal_records", "wal_fpi", "wal_bytes")  # pg_stat_wal, PostgreSQL 14 and later
BATCHES = "qm_consumer_batch_seconds_count"
RECORDS = "qm_consumer_records_total"
REQUESTS = "qm_consumer_kafka_requests_total"
TOP_TABLES = 12  # tables named in the printed line (the JSON holds every one written to)


@dataclass
class Reading:
    pg: dict[str, float]
    # (service, group) -> (batches, records, fetches, all requests to the broker) so far
    groups: dict[tuple[str, str], tuple[float, float, float, float]]
    # schema.table -> rows inserted, updated and deleted since the statistics were reset
    tables: dict[str, float] = field(default_factory=dict)
    # the services whose /metrics answered this reading
    answered: frozenset[str] = frozenset()


class StackCounters:
    """Readings of the stack's counters; `per_job(before, after, jobs)` is the difference."""

    def __init__(self, database_url: str | None, metrics: Mapping[str, str]) -> None:
        self.database_url = database_url
        self.metrics = dict(metrics)  # service name -> its /metrics URL

    async def read(self) -> Reading:
        (pg, tables), (groups, answered) = await asyncio.gather(self._pg(), self._groups())
        return Reading(pg, groups, tables, answered)

    async def _pg(self) -> tuple[dict[str, float], dict[str, float]]:
        if not self.database_url:
            return {}, {}
        try:
            conn = await asyncpg.connect(self.database_url, timeout=5.0)
            try:
                row = await conn.fetchrow(
                    f"SELECT {', '.join(PG_COLUMNS)} FROM pg_stat_database "
                    "WHERE datname = current_database()"
                )
                tables = await conn.fetch(
                    "SELECT schemaname || '.' || relname AS name,"
                    " n_tup_ins + n_tup_upd + n_tup_del AS writes,"
                    " n_tup_hot_upd AS hot FROM pg_stat_user_tables"
                )
                wal = await _wal(conn)
            finally:
                await conn.close()
        except Exception as exc:  # unreachable, refused, a bad URL, a server error
            # The counts are an aid to reading the figures: the bench goes on without them.
            print(f"PostgreSQL's counters not read ({type(exc).__name__}: {exc})")
            return {}, {}
        pg = {c: float(row[c]) for c in PG_COLUMNS} if row else {}
        if row:
            pg["tup_hot_updated"] = float(sum(r["hot"] for r in tables))
        pg.update(wal)
        return pg, {r["name"]: float(r["writes"]) for r in tables}

    async def _groups(
        self,
    ) -> tuple[dict[tuple[str, str], tuple[float, float, float, float]], frozenset[str]]:
        out: dict[tuple[str, str], tuple[float, float, float, float]] = {}
        answered = set()
        async with httpx.AsyncClient(timeout=5.0) as http:
            pages = await asyncio.gather(
                *(http.get(url) for url in self.metrics.values()), return_exceptions=True
            )
        for name, page in zip(self.metrics, pages, strict=True):
            if isinstance(page, BaseException) or page.status_code != 200:
                continue  # a service that does not answer has no figures, not zeros
            answered.add(name)
            for group, counts in group_counts(page.text).items():
                out[(name, group)] = counts
        return out, frozenset(answered)


async def _wal(conn: asyncpg.Connection) -> dict[str, float]:
    try:
        row = await conn.fetchrow(f"SELECT {', '.join(WAL_COLUMNS)} FROM pg_stat_wal")
    except asyncpg.PostgresError:  # before PostgreSQL 14, or not allowed to read it
        return {}
    return {c: float(row[c]) for c in WAL_COLUMNS} if row else {}


def group_counts(page: str) -> dict[str, tuple[float, float, float, float]]:
    """Per consumer group on one /metrics page: (batches, records, fetches, every request to
    the broker) since the service started."""
    counts: dict[str, list[float]] = {}
    for s in parse_metrics(page):
        group = s.labels.get("group")
        if group is None or not math.isfinite(s.value):
            continue
        if s.name == BATCHES:
            counts.setdefault(group, [0.0] * 4)[0] += s.value
        elif s.name == RECORDS:
            counts.setdefault(group, [0.0] * 4)[1] += s.value
        elif s.name == REQUESTS:
            row = counts.setdefault(group, [0.0] * 4)
            row[3] += s.value
            if s.labels.get("api") == "Fetch":
                row[2] += s.value
    return {g: (c[0], c[1], c[2], c[3]) for g, c in counts.items()}


def per_job(before: Reading, after: Reading, jobs: int, seconds: float) -> dict[str, object]:
    """Per job of the phase: PostgreSQL's commits and row writes, by table too; per consumer
    group, batches per job, batches a second, records per batch and fetches per batch (a fetch
    that brings nothing is a poll the broker answers all the same); broker requests in all."""
    if jobs <= 0:
        return {}
    # Only what both readings have: a store or service that did not answer before the phase
    # would otherwise be charged everything it counted since it started.
    delta = {k: after.pg[k] - before.pg[k] for k in after.pg if k in before.pg}
    pg = {k: round(v / jobs, 2) for k, v in delta.items()}
    if delta:
        writes = sum(delta.get(k, 0.0) for k in ("tup_inserted", "tup_updated", "tup_deleted"))
        pg["row_writes"] = round(writes / jobs, 2)
    written = (
        {name: (n - before.tables.get(name, 0.0)) / jobs for name, n in after.tables.items()}
        if before.tables
        else {}
    )
    tables = {k: round(v, 2) for k, v in sorted(written.items(), key=lambda kv: -kv[1]) if v > 0}
    groups: dict[str, dict[str, float | None]] = {}
    batches_in_all = requests = 0.0
    restarted = []
    for key, now in sorted(after.groups.items()):
        if key[0] not in before.answered or key[0] not in after.answered:
            continue
        was = before.groups.get(key, (0.0, 0.0, 0.0, 0.0))  # a group new since: from zero
        if any(n < w for n, w in zip(now, was, strict=True)):
            restarted.append(f"{key[0]}/{key[1]}")  # counters went back: not this phase's
            continue
        batches, records, fetches, sent = (n - w for n, w in zip(now, was, strict=True))
        requests += sent
        if batches <= 0:
            continue
        batches_in_all += batches
        groups[f"{key[0]}/{key[1]}"] = {
            "batches_per_job": round(batches / jobs, 3),
            "batches_per_s": round(batches / seconds, 1) if seconds > 0 else None,
            "records_per_batch": round(records / batches, 1),
            "fetches_per_batch": round(fetches / batches, 1),
        }
    return {
        "pg": pg,
        "tables": tables,
        "batches_per_job": round(batches_in_all / jobs, 2),
        "consumer_requests_per_job": round(requests / jobs, 2),
        "groups": groups,
        "restarted": restarted,
    }


def print_counts(phase: str, counts: Mapping[str, object]) -> None:
    if not counts:
        return
    pg = counts.get("pg") or {}
    if isinstance(pg, dict) and pg:
        print(
            f"{phase}, PostgreSQL per job: {pg.get('xact_commit', 0):.2f} commits, "
            f"{pg.get('row_writes', 0):.1f} row writes (ins {pg.get('tup_inserted', 0):.1f} "
            f"upd {pg.get('tup_updated', 0):.1f}, of them HOT {pg.get('tup_hot_updated', 0):.1f};"
            f" del {pg.get('tup_deleted', 0):.1f})"
        )
        if "wal_records" in pg:
            print(
                f"{phase}, WAL per job (the whole server's): {pg['wal_records']:.1f} records, "
                f"{pg.get('wal_bytes', 0) / 1024:.1f} KiB, {pg.get('wal_fpi', 0):.2f} full pages"
            )
    tables = counts.get("tables") or {}
    if isinstance(tables, dict) and tables:
        top = ", ".join(f"{name} {n:.1f}" for name, n in list(tables.items())[:TOP_TABLES])
        print(f"{phase}, rows written per job by table (most first): {top}")
    groups = counts.get("groups") or {}
    if isinstance(groups, dict) and (groups or counts.get("consumer_requests_per_job")):
        print(
            f"{phase}, consumer batches per job in all: {counts.get('batches_per_job')}; the "
            f"consumers' requests to the broker per job: {counts.get('consumer_requests_per_job')}"
        )
        for name, g in groups.items():
            per_s = g["batches_per_s"]
            print(
                f"  {name:40s} {g['batches_per_job']:7.3f}/job "
                f"{per_s if per_s is not None else float('nan'):7.1f}/s "
                f"{g['records_per_batch']:7.1f} records/batch "
                f"{g['fetches_per_batch']:5.1f} fetches/batch"
            )
    if counts.get("restarted"):
        print(f"{phase}, left out (their counters went back: restarted?): {counts['restarted']}")
