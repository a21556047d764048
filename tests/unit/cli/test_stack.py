"""The dev stack as processes: plan, record, stale records, and stopping without a trace."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from bench.fuzz_health import partition_counts
from cli import infra
from cli import stack as stack_module
from cli.errors import StackError
from cli.main import app
from cli.processes import group_members, is_alive, spawn
from cli.stack import (
    PROJECT_ROOT,
    Service,
    Stack,
    cluster_names,
    default_token,
    robot_fleet_names,
    service_plan,
    topic_partitions_max,
)
from schemas import topics
from services.common.topics import partitions

EXAMPLES = PROJECT_ROOT / "examples"


def test_one_executor_per_cluster_of_the_fleet(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("clusters:\n  - name: a\n  - name: b/c\n")
    plan = service_plan(tmp_path, 8123, cluster_names(fleet))
    assert [s.name for s in plan] == [
        "gateway",
        "queue",
        "scheduler",
        "preemptor",
        "health",
        "meter",
        "autoscaler",
        "serving",
        "scheduler-standby",
        "executor-a",
        "executor-b_c",
    ]
    assert plan[0].port == 8123 and len({s.port for s in plan}) == len(plan)
    assert plan[-1].extra_env == {"QM_EXECUTOR_CLUSTER": "b/c"}
    assert plan[-1].log == tmp_path / "executor-b_c.log"
    # The gateway's dashboard and the health service's SLO evaluator read every other
    # service's /metrics.
    for reader in ("gateway", "health"):
        [me] = [s for s in plan if s.name == reader]
        targets = me.extra_env["QM_METRICS_TARGETS"].split(",")
        assert targets == [
            f"{s.name}=http://127.0.0.1:{s.port}/metrics" for s in plan if s.name != reader
        ]


def test_example_files_give_clusters_and_a_user_token() -> None:
    assert len(cluster_names(EXAMPLES / "fleet.yaml")) >= 3
    assert default_token(EXAMPLES / "auth.yaml") == "dev-vision"


def test_fleet_without_clusters_is_refused(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text("clusters: []\n")
    with pytest.raises(StackError, match="no clusters"):
        cluster_names(tmp_path / "fleet.yaml")


# --- records of earlier runs ----------------------------------------------------------------


def sleeper(tmp_path: Path, module: str) -> subprocess.Popen[bytes]:
    """A process that looks like ``python -m <module>`` and has a child of its own."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    return spawn([sys.executable, "-c", code, "-m", module], log=tmp_path / "sleeper.log")


def recorded(state: Path, services: list[Service]) -> Stack:
    stack = Stack(state, "http://127.0.0.1:1", "dev-vision", services=services)
    state.mkdir(parents=True, exist_ok=True)
    stack.save()
    return stack


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QM_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def test_down_cleans_a_crashed_run(state: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    recorded(state, [Service("gateway", "services.gateway", 1, state / "g.log", pid=dead.pid)])
    result = CliRunner().invoke(app, ["down"])
    assert result.exit_code == 0, result.output
    assert not (state / "stack.json").exists()


def test_down_stops_recorded_services_and_their_children(state: Path, tmp_path: Path) -> None:
    proc = sleeper(tmp_path, "services.queue")
    recorded(state, [Service("queue", "services.queue", 1, state / "q.log", pid=proc.pid)])
    _wait_for_child(proc.pid)
    result = CliRunner().invoke(app, ["down", "--timeout", "5"])
    assert result.exit_code == 0, result.output
    proc.wait(timeout=5)
    assert group_members(proc.pid) == []


def test_up_refuses_while_a_recorded_service_runs(state: Path, tmp_path: Path) -> None:
    proc = sleeper(tmp_path, "services.gateway")
    try:
        recorded(state, [Service("gateway", "services.gateway", 1, state / "g.log", pid=proc.pid)])
        result = CliRunner().invoke(app, ["up", "--detach"])
        assert result.exit_code == 1
        assert "already running" in result.output
    finally:
        Stack.load(state).stop()  # type: ignore[union-attr]
        proc.wait(timeout=5)


def test_up_cleans_leftover_servers_of_a_crashed_run(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    leftover = sleeper(tmp_path, "tansu")  # a broker we started, outliving its services
    stack = recorded(state, [])
    stack.servers = [
        infra.Server("kafka", "127.0.0.1:1", "started", pid=leftover.pid, match="tansu")
    ]
    stack.save()

    def refuse(*_args: Any, **_kwargs: Any) -> Stack:
        raise StackError("not starting in this test")

    monkeypatch.setattr(Stack, "start", refuse)
    result = CliRunner().invoke(app, ["up", "--detach"])
    assert "cleaning up after a previous run" in result.output
    assert "not starting in this test" in result.output
    leftover.wait(timeout=5)
    assert group_members(leftover.pid) == []


def test_a_reused_pid_is_not_ours(state: Path, tmp_path: Path) -> None:
    other = sleeper(tmp_path, "something.else")  # same pid, different program
    try:
        stack = recorded(
            state, [Service("gateway", "services.gateway", 1, state / "g.log", pid=other.pid)]
        )
        assert stack.alive() == []
        stack.stop(timeout=1)
        assert is_alive(other.pid)
    finally:
        other.kill()
        other.wait()


def test_an_unreadable_record_is_reported(state: Path) -> None:
    state.mkdir(parents=True)
    (state / "stack.json").write_text("{")
    result = CliRunner().invoke(app, ["ps"])
    assert result.exit_code == 1 and "unreadable" in result.output


def _wait_for_child(pid: int) -> None:
    import time

    deadline = time.monotonic() + 5
    while len(group_members(pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)


# --- a whole stack of stand-in services --------------------------------------------------

FAKE_SERVICE = textwrap.dedent("""
    import os, subprocess, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    if os.environ.get("FAKE_FAIL") and os.environ.get("QM_EXECUTOR_CLUSTER"):
        print("boom: cannot reach the fleet", flush=True)
        sys.exit(3)
    if os.environ.get("FAKE_SILENT") and os.environ.get("QM_EXECUTOR_CLUSTER"):
        import time
        time.sleep(300)  # never listens: its port is another's
    for key in ("QM_KAFKA_BOOTSTRAP", "QM_DATABASE_URL", "QM_REDIS_URL", "QM_FLEET_FILE"):
        assert os.environ[key], key
    subprocess.Popen(["sleep", "300"])  # a child that must die with the service

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(os.environ["QM_HTTP_PORT"])), Health).serve_forever()
""")


@pytest.fixture
def fake_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    (tmp_path / "fakesvc.py").write_text(FAKE_SERVICE)
    real_plan = stack_module.service_plan

    def plan(*args: Any) -> list[Service]:
        services = real_plan(*args)
        for service in services:
            service.module = "fakesvc"
        return services

    monkeypatch.setattr(stack_module, "service_plan", plan)
    return {"PYTHONPATH": str(tmp_path)}


@pytest.fixture
def stack_env(fake_services: dict[str, str], database_url: str) -> Iterator[dict[str, str]]:
    # An empty QM_KAFKA_BOOTSTRAP makes the stack start (and own) a broker of its own.
    yield {**fake_services, "QM_DATABASE_URL": database_url, "QM_KAFKA_BOOTSTRAP": ""}


def stand_in_policy(tmp_path: Path) -> Path:
    # The stand-in services never read it; the stack only checks that it exists.
    (tmp_path / "policy.yaml").write_text("{}\n")
    return tmp_path / "policy.yaml"


@pytest.mark.integration
def test_stack_starts_records_and_stops_everything(
    tmp_path: Path, stack_env: dict[str, str], spawned: list[int]
) -> None:
    stack = Stack.start(
        tmp_path / "st",
        gateway_port=infra.free_port(),
        env={**stack_env, "QM_TOPIC_PARTITIONS_MAX": ""},  # empty: the dev stack's default
        policy_file=stand_in_policy(tmp_path),
    )
    try:
        record = json.loads((tmp_path / "st" / "stack.json").read_text())
        assert record["ready"] and record["token"] == "dev-vision"
        # Its own broker's topics, made with the dev stack's one partition each.
        names = (topics.JOB_SUBMITTED, topics.PLACEMENT_DECIDED, topics.ROBOT_DESIRED)
        counts = asyncio.run(partition_counts(stack.server("kafka").url, names))
        assert counts == dict.fromkeys(names, 1)
        assert len(record["services"]) == 9 + len(cluster_names(EXAMPLES / "fleet.yaml")) + len(
            robot_fleet_names(EXAMPLES / "fleet.yaml")
        )
        assert {s["name"]: s["how"] for s in record["servers"]}["postgres"] == "env"
        assert stack.alive()
    finally:
        stack.stop()
    assert not (tmp_path / "st" / "stack.json").exists()
    assert [p for p in spawned if is_alive(p) or group_members(p)] == []


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pids of every process the stack spawns (servers and services)."""
    pids: list[int] = []

    def recording(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        process = spawn(*args, **kwargs)
        pids.append(process.pid)
        return process

    monkeypatch.setattr(stack_module, "spawn", recording)
    monkeypatch.setattr(infra, "spawn", recording)
    return pids


@pytest.mark.integration
def test_free_ports_are_distinct_and_avoid_the_taken_ones() -> None:
    taken = infra.free_port()
    ports = infra.free_ports(50, [taken])
    assert len(set(ports)) == 50 and taken not in ports


@pytest.mark.integration
def test_a_port_answered_by_another_process_fails_the_start(
    tmp_path: Path,
    stack_env: dict[str, str],
    spawned: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A service whose port another process answers (its own bind failed) must not count as
    healthy: /healthz names the process that answers."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Impostor(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header(stack_module.PID_HEADER, "1")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    planned = stack_module.service_plan

    def plan(*args: Any) -> list[Service]:
        services = planned(*args)
        [executor] = [s for s in services if s.name.startswith("executor-")][:1]
        executor.port = server.server_address[1]
        return services

    monkeypatch.setattr(stack_module, "service_plan", plan)
    try:
        with pytest.raises(StackError, match="answered by another process"):
            Stack.start(
                tmp_path / "st",
                gateway_port=infra.free_port(),
                env={**stack_env, "FAKE_SILENT": "1"},
                policy_file=stand_in_policy(tmp_path),
            )
    finally:
        server.shutdown()
    assert [p for p in spawned if is_alive(p) or group_members(p)] == []


def test_a_service_that_dies_fails_the_start_and_nothing_is_left(
    tmp_path: Path, stack_env: dict[str, str], spawned: list[int]
) -> None:
    env = {**stack_env, "FAKE_FAIL": "1"}
    with pytest.raises(StackError, match="boom: cannot reach the fleet"):
        Stack.start(
            tmp_path / "st",
            gateway_port=infra.free_port(),
            env=env,
            policy_file=stand_in_policy(tmp_path),
        )
    assert not (tmp_path / "st" / "stack.json").exists()
    assert len(spawned) >= 4  # at least the broker and the three core services
    assert [p for p in spawned if is_alive(p) or group_members(p)] == []


def test_the_dev_stack_makes_one_partition_a_topic_unless_told_otherwise() -> None:
    assert topic_partitions_max({}) == 1
    assert topic_partitions_max({"QM_TOPIC_PARTITIONS_MAX": " "}) == 1  # empty: unset
    assert topic_partitions_max({"QM_TOPIC_PARTITIONS_MAX": " 3 "}) == 3
    assert topic_partitions_max({"QM_TOPIC_PARTITIONS_MAX": "Registry"}) is None


@pytest.mark.parametrize("raw", ["0", "-2", "four", "1.5", "nan"])
def test_a_partition_cap_that_is_no_whole_positive_number_is_refused_with_the_way_out(
    raw: str,
) -> None:
    with pytest.raises(StackError, match=r"QM_TOPIC_PARTITIONS_MAX=.*'registry'"):
        topic_partitions_max({"QM_TOPIC_PARTITIONS_MAX": raw})


def test_a_cap_lowers_a_topics_partitions_and_never_raises_them() -> None:
    submitted = topics.BY_NAME[topics.JOB_SUBMITTED]
    single = topics.BY_NAME[topics.ROBOT_DESIRED]
    assert (submitted.partitions, single.partitions) == (4, 1)
    assert partitions(submitted) == 4
    assert partitions(submitted, 2) == 2
    assert partitions(single, 8) == 1
    with pytest.raises(ValueError, match="at least 1"):
        partitions(submitted, 0)
