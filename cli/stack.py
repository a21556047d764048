"""The whole platform as OS processes: servers, topics, a process per service; and stopping it.

What was started is recorded in ``<state_dir>/stack.json`` as soon as it starts, so that a
run that crashed or was killed can still be cleaned up by ``qm down`` from another process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from cli.errors import InfraError, StackError
from cli.infra import (
    Server,
    create_database,
    drop_database,
    ensure_kafka,
    ensure_postgres,
    ensure_redis,
    free_ports,
    stop_servers,
    with_database,
)
from cli.probes import log_tail, run_blocking
from cli.processes import Target, cmdline, is_alive, spawn, stop_all

PROJECT_ROOT = Path(__file__).resolve().parents[1]
STATE_FILE = "stack.json"
# Every service's /healthz names its process, so a port answered by another is told apart.
PID_HEADER = "x-qm-pid"
FOREIGN_ANSWER_S = 5.0  # how long another process may answer on a service's port
DATABASE = "quartermaster"
HEALTH_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
# The most partitions a topic gets when the stack creates it. One broker and one process per
# service share no work across partitions, and Tansu pays for every partition a fetch names on
# every poll (docs/dev-stack.md); "registry" keeps schemas/topics.py's counts.
TOPIC_PARTITIONS_ENV = "QM_TOPIC_PARTITIONS_MAX"
DEV_TOPIC_PARTITIONS = "1"
# For a stack that should have a deployment's partitions (the e2e tests, the fault benches).
REGISTRY_PARTITIONS = {TOPIC_PARTITIONS_ENV: "registry"}


@dataclass
class Service:
    """One service process: which module it runs and where it answers /healthz."""

    name: str
    module: str
    port: int
    log: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    pid: int | None = None
    # Only in the process that started it; other processes (`qm down`) go by pid.
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/healthz"

    @property
    def match(self) -> str:
        return f"-m {self.module}"

    def running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return self.pid is not None and is_alive(self.pid, self.match)

    def target(self) -> Target:
        return Target(self.pid or 0, signal.SIGTERM, match=self.match, process=self.process)

    def to_record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module": self.module,
            "port": self.port,
            "pid": self.pid,
            "log": str(self.log),
            "env": self.extra_env,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Service:
        return cls(
            record["name"],
            record["module"],
            record["port"],
            Path(record["log"]),
            dict(record.get("env", {})),
            record.get("pid"),
        )


def cluster_names(fleet_file: Path) -> list[str]:
    """The cluster names in a fleet file: one executor process runs per cluster."""
    fleet = yaml.safe_load(fleet_file.read_text()) or {}
    names = [str(c["name"]) for c in fleet.get("clusters") or [] if "name" in c]
    if not names:
        raise StackError(f"{fleet_file} lists no clusters (expected `clusters: [{{name: ...}}]`)")
    return names


def default_token(auth_file: Path) -> str | None:
    """The first `role: user` token in the auth file: what `qm` uses when given none."""
    auth = yaml.safe_load(auth_file.read_text()) or {}
    for entry in auth.get("tokens") or []:
        if entry.get("role") == "user" and entry.get("token"):
            return str(entry["token"])
    return None


def robot_fleet_names(fleet_file: Path) -> list[str]:
    """The robot fleets (edge clusters) in a fleet file: one edge executor runs per fleet."""
    fleet = yaml.safe_load(fleet_file.read_text()) or {}
    return [str(f["name"]) for f in fleet.get("robot_fleets") or [] if "name" in f]


def service_plan(
    logs: Path, gateway_port: int, clusters: list[str], robot_fleets: Sequence[str] = ()
) -> list[Service]:
    """Every service process to start, with the gateway on its fixed port. Two schedulers:
    one leads, the other follows the log and takes over when the leader dies. An executor per
    cluster, and an edge executor per robot fleet."""
    core = ("queue", "scheduler", "preemptor", "health", "meter", "autoscaler", "serving")
    # Every port distinct, and none the gateway's (free_ports holds them all while picking).
    ports = iter(free_ports(len(core) + 1 + len(clusters) + len(robot_fleets), [gateway_port]))
    plan = [Service("gateway", "services.gateway", gateway_port, logs / "gateway.log")]
    plan += [Service(n, f"services.{n}", next(ports), logs / f"{n}.log") for n in core]
    standby = "scheduler-standby"
    plan.append(Service(standby, "services.scheduler", next(ports), logs / f"{standby}.log"))
    for cluster in clusters:
        name = "executor-" + re.sub(r"[^A-Za-z0-9_.-]", "_", cluster)
        plan.append(
            Service(
                name,
                "services.executor",
                next(ports),
                logs / f"{name}.log",
                {"QM_EXECUTOR_CLUSTER": cluster},
            )
        )
    for fleet in robot_fleets:
        name = "edge-" + re.sub(r"[^A-Za-z0-9_.-]", "_", fleet)
        plan.append(
            Service(
                name,
                "services.executor.edge",
                next(ports),
                logs / f"{name}.log",
                {"QM_EDGE_FLEET": fleet},
            )
        )
    # The dashboard's scheduler health page and the health service's SLO evaluator read
    # every other service's /metrics (each reads its own registry directly).
    for reader in (s for s in plan if s.name in ("gateway", "health")):
        reader.extra_env["QM_METRICS_TARGETS"] = ",".join(
            f"{s.name}=http://127.0.0.1:{s.port}/metrics" for s in plan if s is not reader
        )
    return plan


def trace_dir(state_dir: Path) -> Path:
    """Where a stack started with tracing on writes its spans (one JSON lines file each)."""
    return state_dir / "traces"


def _clear_traces(directory: Path) -> None:
    for path in directory.glob("*.jsonl*"):
        path.unlink(missing_ok=True)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def topic_partitions_max(environ: Mapping[str, str]) -> int | None:
    """The stack's cap on partitions per topic (QM_TOPIC_PARTITIONS_MAX): a positive number,
    or `registry` (None) for the registry's counts."""
    raw = environ.get(TOPIC_PARTITIONS_ENV, "").strip() or DEV_TOPIC_PARTITIONS
    if raw.lower() == "registry":
        return None
    try:
        cap = int(raw)
    except ValueError:
        cap = 0
    if cap < 1:
        raise StackError(
            f"{TOPIC_PARTITIONS_ENV}={raw!r}: give a whole number of at least 1, or 'registry' "
            "for the partition counts of schemas/topics.py"
        )
    return cap


def _create_topics(bootstrap: str, max_partitions: int | None) -> None:
    try:
        from services.common.topics import ensure_topics  # the lead's module; loaded late
    except ImportError as exc:
        raise StackError(f"cannot create topics: {exc}") from exc
    run_blocking(ensure_topics(bootstrap, max_partitions=max_partitions))


@dataclass
class Stack:
    """A running (or recorded) platform: its servers, its services, how to reach it."""

    state_dir: Path
    gateway_url: str
    token: str | None = None
    servers: list[Server] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)
    supervisor: dict[str, Any] | None = None  # the foreground `qm up` process, if any
    ready: bool = False
    # The environment the services were started with (only in the process that started them).
    base_env: dict[str, str] | None = field(default=None, repr=False)

    # --- starting ------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        state_dir: Path,
        *,
        gateway_port: int = 8080,
        env: Mapping[str, str] | None = None,
        fleet_file: Path = PROJECT_ROOT / "examples" / "fleet.yaml",
        policy_file: Path = PROJECT_ROOT / "examples" / "policy.yaml",
        auth_file: Path = PROJECT_ROOT / "examples" / "auth.yaml",
        time_scale: float = 60.0,
        reset_database: bool | None = None,
        health_timeout: float = HEALTH_TIMEOUT_S,
        trace: bool = False,
    ) -> Stack:
        """Start everything and return once every service answers /healthz.

        ``reset_database=None`` recreates the database when the broker is one we started:
        its log is empty, so the services' stored state would describe events that are gone.
        On any failure (or Ctrl-C) whatever was started is stopped before raising.

        ``trace`` writes the services' spans under ``<state_dir>/traces`` (`qm trace`), unless
        the environment already says where traces go (QM_TRACE_DIR, QM_OTLP_ENDPOINT).
        """
        files = {
            "QM_FLEET_FILE": fleet_file,
            "QM_POLICY_FILE": policy_file,
            "QM_AUTH_FILE": auth_file,
        }
        for var, path in files.items():
            if not path.is_file():
                raise StackError(f"{var}: {path} does not exist")
        if not _port_free(gateway_port):
            raise StackError(f"port {gateway_port} is taken; choose another (qm up --port N)")
        state_dir = state_dir.resolve()
        (state_dir / "logs").mkdir(parents=True, exist_ok=True)
        plan = service_plan(
            state_dir / "logs",
            gateway_port,
            cluster_names(fleet_file),
            robot_fleet_names(fleet_file),
        )
        environ = {**os.environ, **(env or {})}
        if trace and not environ.get("QM_TRACE_DIR") and not environ.get("QM_OTLP_ENDPOINT"):
            environ["QM_TRACE_DIR"] = str(trace_dir(state_dir))
            _clear_traces(trace_dir(state_dir))  # each run's traces start clean, as its logs do
        max_partitions = topic_partitions_max(environ)
        stack = cls(state_dir, f"http://127.0.0.1:{gateway_port}", default_token(auth_file))
        try:
            stack._start_servers(environ, reset_database)
            _create_topics(stack.server("kafka").url, max_partitions)
            base_env = {
                **{"QM_LOG_FORMAT": "json", "QM_LOG_LEVEL": "info"},
                **environ,
                **stack.server_env(),
                **{k: str(v.resolve()) for k, v in files.items()},
                "QM_TIME_SCALE": str(time_scale),
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(PROJECT_ROOT), environ.get("PYTHONPATH", "")) if p
                ),
            }
            stack.base_env = base_env
            stack._spawn(plan, base_env)
            stack._wait_healthy(health_timeout)
            stack.ready = True
            stack.save()
        except BaseException:
            stack.stop()
            raise
        return stack

    def _start_servers(self, environ: Mapping[str, str], reset_database: bool | None) -> None:
        # Record each server as soon as it exists, so a crash here can still be cleaned up.
        workdir = self.state_dir
        self._add(ensure_kafka(workdir, environ))
        postgres = ensure_postgres(workdir, DATABASE, environ)
        self._add(postgres)
        if reset_database is None:
            reset_database = self.server("kafka").owned
        if reset_database and postgres.how != "env":
            maintenance = with_database(postgres.url, "postgres")
            try:
                drop_database(maintenance, DATABASE, force=False)
            except InfraError as exc:
                raise StackError(
                    f"{exc}: another Quartermaster stack on this PostgreSQL? Stop it, or run "
                    "with --keep-data, or point QM_DATABASE_URL at a database of your own"
                ) from exc
            create_database(maintenance, DATABASE)
        self._add(ensure_redis(workdir, environ))

    def _add(self, server: Server) -> None:
        self.servers.append(server)
        self.save()

    def _spawn(self, plan: list[Service], base_env: Mapping[str, str]) -> None:
        for service in plan:
            service.log.unlink(missing_ok=True)  # each run's log starts clean
            env = {**base_env, "QM_HTTP_PORT": str(service.port), **service.extra_env}
            service.process = spawn(
                [sys.executable, "-m", service.module], log=service.log, env=env, cwd=PROJECT_ROOT
            )
            service.pid = service.process.pid
            self.services.append(service)
        self.save()

    def add_service(self, name: str, module: str, timeout: float = HEALTH_TIMEOUT_S) -> Service:
        """Start one more process of a service (a standby scheduler, say) with the stack's
        environment; it is stopped with the rest."""
        if self.base_env is None:
            raise StackError("add_service needs the process that started the stack")
        logs = self.state_dir / "logs"
        port = free_ports(1, [s.port for s in self.services])[0]
        service = Service(name, module, port, logs / f"{name}.log")
        self._spawn([service], self.base_env)
        self._wait_healthy(timeout, [service])
        return service

    def restart(self, service: Service, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """Start a service that died (or was killed) again, on its port, appending to its log;
        for chaos runs. Only in the process that started the stack."""
        if self.base_env is None:
            raise StackError("restart needs the process that started the stack")
        env = {**self.base_env, "QM_HTTP_PORT": str(service.port), **service.extra_env}
        service.process = spawn(
            [sys.executable, "-m", service.module], log=service.log, env=env, cwd=PROJECT_ROOT
        )
        service.pid = service.process.pid
        self.save()
        self._wait_healthy(timeout, [service])

    def _wait_healthy(self, timeout: float, services: list[Service] | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.services if services is None else services)
        foreign_since: dict[str, float] = {}  # service -> when another process first answered
        with httpx.Client(timeout=1.0) as client:
            while pending:
                for service in list(pending):
                    if not service.running():
                        raise StackError(
                            f"{service.name} exited before becoming healthy; last lines of "
                            f"{service.log}:\n{log_tail(service.log)}"
                        )
                    try:
                        answer = client.get(service.health_url)
                    except httpx.HTTPError:
                        continue  # not listening yet
                    owner = answer.headers.get(PID_HEADER)
                    if owner is not None and service.pid is not None and owner != str(service.pid):
                        # A process killed a moment ago may still answer; one that keeps
                        # answering holds the port, and ours cannot have it.
                        since = foreign_since.setdefault(service.name, time.monotonic())
                        if time.monotonic() - since > FOREIGN_ANSWER_S:
                            raise StackError(
                                f"{service.name}'s port {service.port} is answered by another "
                                f"process (pid {owner}); last lines of {service.log}:\n"
                                f"{log_tail(service.log)}"
                            )
                        continue
                    if answer.status_code == 200:
                        pending.remove(service)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(s.name for s in pending)
                    raise StackError(
                        f"not healthy after {timeout:.0f}s: {names}; last lines of "
                        f"{pending[0].log}:\n{log_tail(pending[0].log)}"
                    )
                time.sleep(0.1)

    # --- looking at it -------------------------------------------------------------------

    def server(self, name: str) -> Server:
        return next(s for s in self.servers if s.name == name)

    def server_env(self) -> dict[str, str]:
        urls = {s.name: s.url for s in self.servers}
        return {
            "QM_KAFKA_BOOTSTRAP": urls["kafka"],
            "QM_DATABASE_URL": urls["postgres"],
            "QM_REDIS_URL": urls["redis"],
        }

    def alive(self) -> list[str]:
        """Names of recorded processes (services and servers we own) still running."""
        names = [s.name for s in self.services if s.running()]
        names += [
            s.name
            for s in self.servers
            if s.owned and s.pid is not None and is_alive(s.pid, s.match)
        ]
        return names

    def supervisor_alive(self) -> bool:
        if not self.supervisor:
            return False
        return is_alive(int(self.supervisor["pid"]), self.supervisor.get("match"))

    def exited(self) -> list[Service]:
        return [s for s in self.services if not s.running()]

    # --- recording -----------------------------------------------------------------------

    def claim_supervision(self) -> None:
        """Record this process as the foreground `qm up`, so `qm down` asks it to stop."""
        self.supervisor = {"pid": os.getpid(), "match": cmdline(os.getpid())}
        self.save()

    def to_record(self) -> dict[str, Any]:
        return {
            "version": 1,
            "state_dir": str(self.state_dir),
            "gateway_url": self.gateway_url,
            "token": self.token,
            "ready": self.ready,
            "supervisor": self.supervisor,
            "servers": [s.to_record() for s in self.servers],
            "services": [s.to_record() for s in self.services],
        }

    def save(self) -> None:
        path = self.state_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_record(), indent=2) + "\n")
        os.replace(tmp, path)  # readers never see half a file

    @classmethod
    def load(cls, state_dir: Path) -> Stack | None:
        """The stack recorded in ``state_dir``, or None if nothing is recorded."""
        path = state_dir / STATE_FILE
        if not path.exists():
            return None
        try:
            rec = json.loads(path.read_text())
            return cls(
                Path(rec["state_dir"]),
                rec["gateway_url"],
                rec.get("token"),
                [Server.from_record(s) for s in rec.get("servers", [])],
                [Service.from_record(s) for s in rec.get("services", [])],
                rec.get("supervisor"),
                bool(rec.get("ready")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise StackError(
                f"{path} is unreadable ({exc}); remove it after checking `ps`"
            ) from exc

    # --- stopping ------------------------------------------------------------------------

    def stop(
        self, timeout: float = STOP_TIMEOUT_S, on_step: Callable[[str], None] | None = None
    ) -> list[int]:
        """Stop services (SIGTERM, then SIGKILL), then the servers we started; forget the stack.

        Returns the pids that had to be killed. Safe to call on a stack whose processes
        are already gone (a crashed run): it then only removes the record.
        """
        note = on_step or (lambda _msg: None)
        targets = [s.target() for s in self.services if s.pid]
        note(f"stopping {len(targets)} services")
        killed = stop_all(targets, timeout=timeout)
        owned = [s for s in reversed(self.servers) if s.owned]
        if owned:
            note("stopping " + ", ".join(f"{s.name} ({s.how})" for s in owned))
        stop_servers(owned, timeout=timeout)
        (self.state_dir / STATE_FILE).unlink(missing_ok=True)
        return killed
