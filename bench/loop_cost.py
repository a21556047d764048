"""A service's client CPU per PostgreSQL transaction on each event loop the services can run
on (QM_EVENT_LOOP: uvloop, Python's asyncio), in the same run, alternating.

    python bench/loop_cost.py                 # 3,000 transactions, 3 rounds of each loop
    python bench/loop_cost.py --transactions 10000 --rounds 5

Each round is a fresh process (one loop per process) that takes a connection from an asyncpg
pool of one, runs a transaction of one `SELECT` (BEGIN, the statement, COMMIT: three round
trips, as a service's batch does around its statements) and gives the connection back, over
and over, and reads its own CPU time (user and system) around the loop. PostgreSQL is the one
QM_DATABASE_URL names (default: 127.0.0.1:5432, database `test`). The figure is the client's
CPU, what a service spends per transaction in its event loop, socket calls and asyncpg; the
server's is the same on either loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

LOOPS = ("asyncio", "uvloop")
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


async def _transactions(dsn: str, count: int) -> dict[str, float]:
    import asyncpg

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:

        async def one() -> None:
            async with pool.acquire() as conn, conn.transaction():
                await conn.fetchval("SELECT $1::int", 1)

        for _ in range(min(200, count)):  # warm: the statement prepared, the pool filled
            await one()
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        for _ in range(count):
            await one()
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        await pool.close()
    user = after.ru_utime - before.ru_utime
    system = after.ru_stime - before.ru_stime
    return {
        "cpu_us": (user + system) / count * 1e6,
        "user_us": user / count * 1e6,
        "system_us": system / count * 1e6,
        "wall_us": wall / count * 1e6,
    }


def _child(loop: str, dsn: str, count: int) -> None:
    if loop == "uvloop":
        import uvloop

        figures = uvloop.run(_transactions(dsn, count))
    else:
        figures = asyncio.run(_transactions(dsn, count))
    print(json.dumps(figures))


def _round(loop: str, dsn: str, count: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", loop, "--dsn", dsn, "--transactions", str(count)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dsn", default=os.environ.get("QM_DATABASE_URL", DEFAULT_DSN))
    parser.add_argument("--child", choices=LOOPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.dsn, args.transactions)
        return
    runs: dict[str, list[dict[str, float]]] = {loop: [] for loop in LOOPS}
    for i in range(args.rounds):
        order = LOOPS if i % 2 == 0 else LOOPS[::-1]
        for loop in order:
            runs[loop].append(_round(loop, args.dsn, args.transactions))
    medians: dict[str, dict[str, float]] = {}
    for loop, figures in runs.items():
        medians[loop] = {
            key: round(statistics.median(f[key] for f in figures), 1) for key in figures[0]
        }
        shown = ", ".join(f"{f['cpu_us']:.0f}" for f in figures)
        m = medians[loop]
        print(
            f"{loop:8s}: client CPU {m['cpu_us']:.0f} us per transaction (user {m['user_us']:.0f},"
            f" system {m['system_us']:.0f}; runs {shown}); wall {m['wall_us']:.0f} us"
        )
    ratio = round(medians["uvloop"]["cpu_us"] / medians["asyncio"]["cpu_us"], 2)
    print(f"uvloop / asyncio, client CPU per transaction: {ratio}")
    import uvloop

    print(
        json.dumps(
            {
                "bench": "loop_cost",
                "cpu_us_per_transaction": {k: v["cpu_us"] for k, v in medians.items()},
                "uvloop_over_asyncio": ratio,
                "setup": {
                    "cores": os.cpu_count(),
                    "transactions": args.transactions,
                    "rounds": args.rounds,
                    "statement": "SELECT $1::int in a transaction, asyncpg pool of one",
                    "python": platform.python_version(),
                    "uvloop": uvloop.__version__,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
