"""Finding or starting Kafka, PostgreSQL and Redis, and leaving nothing running afterwards."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli import infra
from cli.errors import InfraError, ServerTimeout
from cli.probes import kafka_answers, postgres_answers, redis_answers
from cli.processes import cmdline, group_members, is_alive


def always(result: bool) -> Any:
    return lambda *_args, **_kwargs: result


def fake_start(name: str) -> Any:
    return lambda workdir, *_a, **_k: infra.Server(name, f"{name}-started", "started")


# --- the order: environment, then the machine's server, then one we start ------------------


@pytest.mark.parametrize(
    ("environ", "local_answers", "expected"),
    [
        ({"QM_KAFKA_BOOTSTRAP": "kafka.example:9092"}, True, ("env", "kafka.example:9092")),
        ({}, True, ("local", infra.LOCAL_KAFKA)),
        ({}, False, ("started", "kafka-started")),
    ],
)
def test_kafka_order(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    environ: dict[str, str],
    local_answers: bool,
    expected: tuple[str, str],
) -> None:
    monkeypatch.setattr(infra, "kafka_answers", always(local_answers or bool(environ)))
    monkeypatch.setattr(infra, "start_kafka", fake_start("kafka"))
    server = infra.ensure_kafka(tmp_path, environ)
    assert (server.how, server.url) == expected


@pytest.mark.parametrize(
    ("environ", "local_answers", "expected"),
    [
        ({"QM_REDIS_URL": "redis://r:1/2"}, True, ("env", "redis://r:1/2")),
        ({}, True, ("local", infra.LOCAL_REDIS)),
        ({}, False, ("started", "redis-started")),
    ],
)
def test_redis_order(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    environ: dict[str, str],
    local_answers: bool,
    expected: tuple[str, str],
) -> None:
    monkeypatch.setattr(infra, "redis_answers", always(local_answers or bool(environ)))
    monkeypatch.setattr(infra, "start_redis", fake_start("redis"))
    server = infra.ensure_redis(tmp_path, environ)
    assert (server.how, server.url) == expected


@pytest.mark.parametrize(
    ("environ", "local_answers", "expected"),
    [
        ({"QM_DATABASE_URL": "postgresql://h/db"}, True, ("env", "postgresql://h/db")),
        ({}, True, ("local", "postgresql://postgres@127.0.0.1:5432/qm")),
        ({}, False, ("embedded", "postgresql://postgres:@/qm?host=/sock")),
    ],
)
def test_postgres_order(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    environ: dict[str, str],
    local_answers: bool,
    expected: tuple[str, str],
) -> None:
    monkeypatch.setattr(infra, "postgres_answers", always(local_answers or bool(environ)))
    monkeypatch.setattr(infra, "create_database", infra.with_database)
    monkeypatch.setattr(
        infra,
        "start_postgres",
        lambda workdir: infra.Server(
            "postgres", "postgresql://postgres:@/postgres?host=/sock", "embedded"
        ),
    )
    server = infra.ensure_postgres(tmp_path, "qm", environ)
    assert (server.how, server.url) == expected


def test_a_configured_url_that_never_answers_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(infra, "ENV_TIMEOUT_S", 0.2)
    with pytest.raises(ServerTimeout, match="from the environment"):
        infra.ensure_redis(tmp_path, {"QM_REDIS_URL": f"redis://127.0.0.1:{infra.free_port()}"})


def test_only_servers_we_started_are_owned() -> None:
    owned = {
        how: infra.Server("x", "u", how).owned for how in ("env", "local", "started", "embedded")
    }
    assert owned == {"env": False, "local": False, "started": True, "embedded": True}


def test_server_record_round_trips() -> None:
    server = infra.Server(
        "kafka", "127.0.0.1:1", "started", pid=12, match="tcp://x", log=Path("/tmp/k.log")
    )
    assert infra.Server.from_record(server.to_record()) == server


def test_with_database_keeps_socket_host() -> None:
    url = "postgresql://postgres:@/postgres?host=/tmp/pg"
    assert infra.with_database(url, "qm") == "postgresql://postgres:@/qm?host=/tmp/pg"


def test_database_names_are_plain_identifiers() -> None:
    with pytest.raises(InfraError):
        infra.create_database(infra.LOCAL_POSTGRES, 'x"; DROP DATABASE y; --')


# --- real processes -------------------------------------------------------------------------


def running_with(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text``."""
    pids = [int(p.name) for p in Path("/proc").glob("[0-9]*")]
    return [pid for pid in pids if is_alive(pid) and text in (cmdline(pid) or "")]


def assert_gone(server: infra.Server) -> None:
    assert server.pid is not None
    assert not is_alive(server.pid)
    assert group_members(server.pid) == []


def test_private_tansu_starts_answers_and_stops_without_trace(tmp_path: Path) -> None:
    server = infra.start_kafka(tmp_path)
    try:
        assert server.how == "started" and kafka_answers(server.url)
    finally:
        infra.stop(server)
    assert_gone(server)
    assert not kafka_answers(server.url, timeout=0.2)


def environment_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


@pytest.mark.parametrize(("asked", "expected"), [(None, "1"), ("2", "2")])
def test_the_private_broker_runs_one_runtime_thread_unless_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: str | None, expected: str
) -> None:
    """Tokio's runtime reads its worker count from TOKIO_WORKER_THREADS."""
    if asked is None:
        monkeypatch.delenv("TOKIO_WORKER_THREADS", raising=False)
    else:
        monkeypatch.setenv("TOKIO_WORKER_THREADS", asked)
    server = infra.start_kafka(tmp_path)
    try:
        assert server.pid is not None
        assert environment_of(server.pid)["TOKIO_WORKER_THREADS"] == expected
    finally:
        infra.stop(server)


def test_private_redis_starts_answers_and_stops_without_trace(tmp_path: Path) -> None:
    server = infra.start_redis(tmp_path)
    try:
        assert server.how in ("started", "embedded") and redis_answers(server.url)
    finally:
        infra.stop(server)
    assert_gone(server)


def test_a_recorded_server_is_stopped_by_pid_from_another_process(tmp_path: Path) -> None:
    server = infra.start_kafka(tmp_path)
    recorded = infra.Server.from_record(server.to_record())  # as `qm down` would see it
    infra.stop(recorded)
    assert_gone(server)
    server.process.wait(timeout=5)  # type: ignore[union-attr]  # reap: we are its parent


def test_a_broker_that_cannot_bind_fails_fast_with_its_log(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerTimeout, match="kafka"):
            infra.start_kafka(tmp_path, port=port)
    assert running_with(f"tcp://127.0.0.1:{port}") == []


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port that accepts connections and never says anything."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    accepted: list[socket.socket] = []
    thread = threading.Thread(target=lambda: accepted.append(sock.accept()[0]), daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    for conn in accepted:
        conn.close()
    sock.close()


def test_an_open_port_is_not_a_broker(silent_listener: int) -> None:
    assert not kafka_answers(f"127.0.0.1:{silent_listener}", timeout=0.3)


def test_redis_binary_exists() -> None:
    binary, how = infra.redis_binary()
    assert binary.exists() and how in ("started", "embedded")


@pytest.mark.integration
def test_create_and_drop_database(postgres_server_url: str) -> None:
    name = f"qm_unit_{infra.free_port()}"
    url = infra.create_database(postgres_server_url, name)
    assert infra.create_database(postgres_server_url, name) == url  # idempotent
    assert postgres_answers(url)
    infra.drop_database(postgres_server_url, name)
    assert not postgres_answers(url)


@pytest.mark.integration
def test_embedded_postgres_starts_and_stops(tmp_path: Path) -> None:
    server = infra.start_postgres(tmp_path)
    try:
        url = infra.create_database(server.url, "quartermaster")
        assert server.how == "embedded" and postgres_answers(url)
    finally:
        infra.stop(server)
    assert server.pid is not None and not is_alive(server.pid)


@pytest.mark.integration
def test_a_database_in_use_is_not_dropped_without_force(postgres_server_url: str) -> None:
    import asyncio

    import asyncpg

    name = f"qm_unit_busy_{infra.free_port()}"
    url = infra.create_database(postgres_server_url, name)

    async def while_connected() -> None:
        conn = await asyncpg.connect(url)
        try:
            with pytest.raises(InfraError, match="in use"):
                await asyncio.to_thread(infra.drop_database, postgres_server_url, name, force=False)
        finally:
            await conn.close()

    asyncio.run(while_connected())
    infra.drop_database(postgres_server_url, name, force=False)
    assert not postgres_answers(url)
