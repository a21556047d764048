"""Store outages under load: PostgreSQL, then Redis, then both go away for a while and come
back, while jobs arrive at a steady rate. The services must log, back off and recover, and
lose nothing: the chaos audit (bench/chaos.py) must stay clean.

The stack talks to PostgreSQL and Redis through cuttable TCP proxies run by this process: a
cut closes every open connection and refuses new ones, exactly what a restarting server looks
like from a client, without touching a server other tests may share. When Redis comes back it
comes back empty (its keys are flushed: a restart without persistence, which takes the
scheduler's lease and the singletons' leases with it).

Prints, then one JSON line: jobs, terminal_once, lost, duplicate_effects, double_allocations,
wrong_outcome, recovery_s (per outage: from the store's return until a probe job submitted
then is placed), retries logged per service, stall alerts, services that died.

    python bench/outages.py                       # 30 jobs/s, outages of 8 s
    python bench/outages.py --rate 60 --down-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiokafka import AIOKafkaProducer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chaos import audit, submit
from bench.machine import describe
from cli import infra
from cli.probes import postgres_answers
from cli.stack import REGISTRY_PARTITIONS, Stack
from schemas import topics
from schemas.envelope import Envelope
from tests.integration.kafka_tools import collect

Connect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class CuttableProxy:
    """A TCP proxy on 127.0.0.1:`port` to whatever `connect` opens; `cut()` drops every
    connection and refuses new ones until `restore()`. Runs on its own thread and loop."""

    def __init__(self, connect: Connect) -> None:
        self.port = infra.free_port()
        self._connect = connect
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._listen())

    def _call(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await self._connect()
        except OSError:
            client_w.close()
            return
        self._open.update((client_w, server_w))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))
        self._open.difference_update((client_w, server_w))

    async def _cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()  # a reset, as a dying server gives
        self._open.clear()
        await self._server.wait_closed()

    def cut(self) -> None:
        self._call(self._cut())

    def restore(self) -> None:
        self._call(self._listen())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._cut())
        self._loop.call_soon_threadsafe(self._loop.stop)


def connector(url: str) -> Connect:
    """How to reach the server of a postgresql:// or redis:// URL (TCP, or PostgreSQL's Unix
    socket when the URL names a socket directory)."""
    parts = urlsplit(url)
    query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
    socket_dir = query.get("host")
    port = parts.port or (5432 if parts.scheme.startswith("postgres") else 6379)
    if socket_dir and socket_dir.startswith("/"):
        path = f"{socket_dir}/.s.PGSQL.{query.get('port', port)}"
        return lambda: asyncio.open_unix_connection(path)
    host = parts.hostname or "127.0.0.1"
    return lambda: asyncio.open_connection(host, port)


def through(url: str, proxy: CuttableProxy, database: str | None = None) -> str:
    """`url` pointed at the proxy (TCP on 127.0.0.1)."""
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    path = f"/{database}" if database else parts.path
    return f"{parts.scheme}://{user}127.0.0.1:{proxy.port}{path}"


@contextlib.contextmanager
def servers(workdir: Path) -> Iterator[tuple[str, str, str]]:
    """A broker and a Redis of our own, and a fresh database on a PostgreSQL server (the
    machine's, else an embedded one): (kafka, postgres server url, redis url)."""
    kafka = infra.start_kafka(workdir / "kafka")
    redis = infra.start_redis(workdir / "redis")
    own_pg = None
    try:
        pg_url = os.environ.get("QM_DATABASE_URL") or infra.LOCAL_POSTGRES
        if not postgres_answers(pg_url):
            own_pg = infra.start_postgres(workdir / "postgres")
            pg_url = own_pg.url
        yield kafka.url, pg_url, redis.url
    finally:
        for server in (own_pg, redis, kafka):
            if server is not None:
                infra.stop(server)


async def probe_placed(bootstrap: str, tag: str, timeout_s: float) -> float:
    """Submit one small job now; seconds until its placement is decided."""
    job_id = f"probe-{tag}-{uuid.uuid4().hex[:6]}"
    spec = {
        "tenant": "vision",
        "job_id": job_id,
        "resources": {"accelerators": 1, "accelerator_types": ["L4"]},
        "labels": {"sim_duration_s": "30"},
    }
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    started = time.monotonic()
    try:
        env = Envelope(type="JobSubmitted", producer="outages", payload=spec)
        await producer.send_and_wait(
            topics.JOB_SUBMITTED, env.model_dump_json().encode(), key=job_id.encode()
        )
    finally:
        await producer.stop()
    got = await collect(
        bootstrap,
        (topics.PLACEMENT_DECIDED,),
        lambda _t, e: e["payload"].get("job_id") == job_id,
        count=1,
        timeout_s=timeout_s,
    )
    if not got:
        raise AssertionError(f"probe {job_id} was not placed within {timeout_s:.0f} s")
    return time.monotonic() - started


async def flush_redis(url: str) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    try:
        await client.flushall()
    finally:
        await client.aclose()


async def outages(
    stack: Stack,
    bootstrap: str,
    pg: CuttableProxy,
    redis: CuttableProxy,
    redis_url: str,
    down_s: float,
    gap_s: float,
) -> dict[str, float]:
    """PostgreSQL, then Redis, then both: each down for `down_s`, `gap_s` apart."""
    recovery: dict[str, float] = {}
    for name, proxies in (("postgres", [pg]), ("redis", [redis]), ("both", [pg, redis])):
        await asyncio.sleep(gap_s)
        print(f"{name}: down for {down_s:.0f} s", flush=True)
        for proxy in proxies:
            await asyncio.to_thread(proxy.cut)
        await asyncio.sleep(down_s)
        if redis in proxies:
            await flush_redis(redis_url)  # back empty, as after a restart
        for proxy in proxies:
            await asyncio.to_thread(proxy.restore)
        recovery[name] = round(await probe_placed(bootstrap, name, timeout_s=120), 2)
        print(f"{name}: back; a new job was placed {recovery[name]} s later", flush=True)
    return recovery


def alive(stack: Stack) -> list[str]:
    """Names of service processes that are not running any more."""
    dead = []
    for service in stack.services:
        if service.process is not None and service.process.poll() is not None:
            dead.append(service.name)
    return dead


def retries_logged(stack: Stack) -> dict[str, int]:
    counts = {}
    for service in stack.services:
        text = service.log.read_text(errors="replace") if service.log.exists() else ""
        counts[service.name] = text.count("consumer failed; retrying")
    return counts


async def run(
    stack: Stack,
    bootstrap: str,
    pg: CuttableProxy,
    redis: CuttableProxy,
    redis_url: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    seconds = 4 * args.gap_s + 3 * args.down_s
    run_id = f"{args.seed}-{uuid.uuid4().hex[:6]}"
    load = asyncio.create_task(
        submit(bootstrap, random.Random(args.seed), args.rate, seconds, run_id)
    )
    recovery = await outages(stack, bootstrap, pg, redis, redis_url, args.down_s, args.gap_s)
    expected = await load
    figures = await audit(bootstrap, expected, args.drain_s)
    stalls = await collect(
        bootstrap,
        (topics.ALERT_RAISED,),
        lambda _t, e: e["payload"].get("cause") == "consumer_stalled",
        count=1000,
        timeout_s=3,
    )
    return {
        "jobs": len(expected),
        **figures,
        "recovery_s": recovery,
        "retries_logged": retries_logged(stack),
        "stall_alerts": len(stalls),
        "died": alive(stack),
    }


def outage_run(
    rate: float, down_s: float, gap_s: float, seed: int, drain_s: float, keep: Path | None = None
) -> dict[str, Any]:
    """Start servers, proxies and a stack of its own, run the outages, return the figures."""
    args = argparse.Namespace(rate=rate, down_s=down_s, gap_s=gap_s, seed=seed, drain_s=drain_s)
    with contextlib.ExitStack() as scope:
        if keep is None:
            tmp = Path(scope.enter_context(tempfile.TemporaryDirectory(prefix="qm-outages-")))
        else:
            keep.mkdir(parents=True, exist_ok=True)
            tmp = keep
        kafka, pg_server, redis_url = scope.enter_context(servers(tmp))
        database = f"qm_outages_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        infra.create_database(pg_server, database)
        scope.callback(infra.drop_database, pg_server, database)
        pg = CuttableProxy(connector(pg_server))
        scope.callback(pg.close)
        redis = CuttableProxy(connector(redis_url))
        scope.callback(redis.close)
        stack = Stack.start(
            tmp / "state",
            gateway_port=infra.free_port(),
            env={
                "QM_KAFKA_BOOTSTRAP": kafka,
                "QM_DATABASE_URL": through(pg_server, pg, database),
                "QM_REDIS_URL": through(redis_url, redis),
                # Long enough outages raise the stall alert within the run.
                "QM_STALL_ALERT_AFTER_S": str(max(1.0, down_s / 2)),
                "QM_SINGLETON_TTL_S": "4",
                **REGISTRY_PARTITIONS,  # a deployment's partitions
            },
            time_scale=600.0,
        )
        scope.callback(stack.stop)
        return asyncio.run(run(stack, kafka, pg, redis, redis_url, args))
    raise AssertionError("unreachable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--down-s", type=float, default=8.0)
    parser.add_argument("--gap-s", type=float, default=10.0)
    parser.add_argument("--drain-s", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--keep", type=Path, help="keep the stack's state and logs here")
    args = parser.parse_args()
    started = time.monotonic()
    figures = outage_run(args.rate, args.down_s, args.gap_s, args.seed, args.drain_s, args.keep)
    figures.pop("samples", None)
    print(
        f"jobs {figures['jobs']}: terminal once {figures['terminal_once']}, lost "
        f"{figures['lost']}, duplicate effects {figures['duplicate_effects']}, over-committed "
        f"nodes {figures['double_allocations']}, resent {figures['redelivered']}; "
        f"recovery {figures['recovery_s']}; stall "
        f"alerts {figures['stall_alerts']}; died {figures['died'] or 'none'}; "
        f"{time.monotonic() - started:.0f} s"
    )
    print(
        json.dumps(
            {
                "bench": "outages",
                **figures,
                "setup": {
                    **describe(),
                    "rate_per_s": args.rate,
                    "down_s": args.down_s,
                    "gap_s": args.gap_s,
                    "seed": args.seed,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
