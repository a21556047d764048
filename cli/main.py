"""The `qm` command: the dev stack (up, down, ps, logs) and the job commands, wired together.

`qm` should start quickly, and most commands only talk to the gateway. It is built on click
alone, and the root group imports a command's module only when that command is run (or the full
help is shown): `qm list` loads the job commands, the HTTP client and nothing of the dev stack's
machinery, the simulator, numpy or the platform's services. tests/unit/cli/test_startup.py keeps
it that way.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

import click

from cli import out
from cli.client import state_dir
from cli.errors import QmError, StackError
from cli.params import path_type

if TYPE_CHECKING:
    import httpx
    from rich.panel import Panel

    from cli.stack import Stack

# Commands defined in other modules, in the order `qm --help` lists them after the stack's own:
# name -> "module:attribute" of a click command or group.
LAZY_COMMANDS = {
    "submit": "cli.jobs:submit",
    "status": "cli.jobs:status",
    "cancel": "cli.jobs:cancel",
    "watch": "cli.jobs:watch",
    "explain": "cli.jobs:explain",
    "list": "cli.jobs:list_jobs",
    "usage": "cli.usage:usage",
    "pools": "cli.pools:pools",
    "queues": "cli.fleet:queues",
    "nodes": "cli.fleet:nodes",
    "node": "cli.fleet:node",
    "top": "cli.fleet:top",
    "serve": "cli.services:serve",
    "services": "cli.services:services",
    "scale": "cli.services:scale",
    "unserve": "cli.services:unserve",
    "rollout": "cli.services:rollout",
    "robots": "cli.robots:robots",
    "deploy": "cli.robots:deploy",
    "deployments": "cli.robots:deployments",
    "deployment": "cli.robots:deployment",
    "trace": "cli.traces:trace",
    "fault": "cli.faults:fault",
    # The simulator is optional: `qm` works without it (sim.cli defers its heavy imports).
    "sim": "sim.cli:sim",
}
OPTIONAL_MODULES = frozenset({"sim.cli"})


class LazyGroup(click.Group):
    """A group whose commands in `LAZY_COMMANDS` are imported when first asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        # The group's own commands first, then the table's order (loading one keeps its place).
        return [*(name for name in self.commands if name not in LAZY_COMMANDS), *LAZY_COMMANDS]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands or cmd_name not in LAZY_COMMANDS:
            return self.commands.get(cmd_name)
        module_name, _, attribute = LAZY_COMMANDS[cmd_name].partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if module_name in OPTIONAL_MODULES and exc.name == module_name.partition(".")[0]:
                return None
            raise
        command = getattr(module, attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{LAZY_COMMANDS[cmd_name]} is not a click command")
        self.commands[cmd_name] = command
        return command


@click.group(
    "qm",
    cls=LazyGroup,
    # Help as wide as the terminal, to 120 columns (click stops at 80 and cuts summaries).
    context_settings={"show_default": True, "max_content_width": 120},
)
def app() -> None:
    """Quartermaster: schedule ML jobs on a fleet of accelerator clusters."""


console = out.LazyConsole()  # rich only for the commands that print through it
errors = out.LazyConsole(stderr=True)


def _fail(message: str, code: int = 1) -> NoReturn:
    out.error(message)
    raise click.exceptions.Exit(code)


def _example(path: Path) -> Path:
    """A relative path from the current directory, else from the repository root."""
    from cli.stack import PROJECT_ROOT

    if path.is_absolute() or path.exists():
        return path.resolve()
    return (PROJECT_ROOT / path).resolve()


def _load(directory: Path) -> Stack | None:
    from cli.stack import Stack

    try:
        return Stack.load(directory)
    except StackError as exc:
        _fail(str(exc))


def _clear_stale(directory: Path) -> None:
    """Refuse to start twice; clean up after a run that crashed or was killed."""
    stack = _load(directory)
    if stack is None:
        return
    # Running services or a live `qm up` mean a real stack; servers alone are leftovers.
    running = [s.name for s in stack.services if s.running()]
    if running or stack.supervisor_alive():
        names = ", ".join(running or ["qm up"])
        _fail(f"a stack is already running here ({names}); see `qm ps`, stop it with `qm down`")
    console.print("[yellow]cleaning up after a previous run that did not stop cleanly[/yellow]")
    stack.stop()


def _raise_interrupt(_signum: int, _frame: FrameType | None) -> None:
    # SIGTERM (from `qm down` or a process manager) takes the same path as Ctrl-C.
    raise KeyboardInterrupt


def _summary(stack: Stack) -> Panel:
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from cli.probes import redact

    services = Table(header_style="bold", box=None)
    for column in ("service", "pid", "url", "log"):
        services.add_column(column)
    for s in stack.services:
        services.add_row(s.name, str(s.pid), f"http://127.0.0.1:{s.port}", str(s.log))
    servers = Table(header_style="bold", box=None)
    for column in ("server", "source", "url"):
        servers.add_column(column)
    for server in stack.servers:
        servers.add_row(server.name, server.how, redact(server.url))
    hints = Text.from_markup(
        f"[bold]gateway[/bold] {stack.gateway_url}  (API docs: {stack.gateway_url}/docs)  "
        f"[bold]token[/bold] {stack.token}\n\n[bold]try[/bold]\n"
        "  qm submit -f examples/jobs/train-8xh100.yaml --wait\n"
        "  qm list\n  qm watch JOB_ID\n  qm status JOB_ID\n  qm ps; qm logs gateway -f\n"
        "  qm down"
    )
    body = Group(services, Text(), servers, Text(), hints)
    return Panel(body, title="Quartermaster is up", title_align="left")


@app.command()
@click.option("--detach", "-d", is_flag=True, help="Return, leave it running.")
@click.option("--port", type=int, default=8080, help="Gateway (REST API) port.")
@click.option("--time-scale", type=float, default=60.0, help="Virtual seconds per real second.")
@click.option("--fleet", type=path_type(), default="examples/fleet.yaml", help="Fleet file.")
@click.option("--policy", type=path_type(), default="examples/policy.yaml", help="Policy file.")
@click.option("--auth", type=path_type(), default="examples/auth.yaml", help="Auth (tokens) file.")
@click.option(
    "--keep-data/--no-keep-data",
    default=False,
    help="Keep the database even when the broker starts empty.",
)
@click.option(
    "--trace/--no-trace",
    default=True,
    help="Write every job's trace under the state directory (qm trace).",
)
def up(
    detach: bool,
    port: int,
    time_scale: float,
    fleet: Path,
    policy: Path,
    auth: Path,
    keep_data: bool,
    trace: bool,
) -> None:
    """Start Kafka, PostgreSQL, Redis and every service; Ctrl-C stops everything."""
    from cli.stack import Stack

    directory = state_dir()
    _clear_stale(directory)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with console.status("starting servers and services…"):
            stack = Stack.start(
                directory,
                gateway_port=port,
                time_scale=time_scale,
                fleet_file=_example(fleet),
                policy_file=_example(policy),
                auth_file=_example(auth),
                reset_database=False if keep_data else None,
                trace=trace,
            )
    except KeyboardInterrupt:
        _fail("interrupted; everything started so far was stopped", 130)
    except QmError as exc:
        _fail(f"{exc}\n(everything started so far was stopped)")
    console.print(_summary(stack))
    if detach:
        console.print("running in the background; stop it with [bold]qm down[/bold]")
        return
    stack.claim_supervision()
    console.print("[dim]Ctrl-C stops everything[/dim]")
    _supervise(stack)


def _supervise(stack: Stack) -> None:
    reported: set[str] = set()
    try:
        while True:
            time.sleep(1.0)
            for service in stack.exited():
                if service.name not in reported:
                    reported.add(service.name)
                    code = service.process.poll() if service.process else None
                    errors.print(
                        f"[red]{service.name} exited (code {code})[/red]; "
                        f"see qm logs {service.name}"
                    )
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C must not leave half the stack running; stopping is bounded anyway.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        console.print()
        stack.stop(on_step=lambda msg: console.print(f"[dim]{msg}[/dim]"))
        console.print("stopped")


@app.command()
@click.option("--timeout", type=float, default=10.0, help="Seconds before SIGKILL.")
def down(timeout: float) -> None:
    """Stop the stack started by `qm up` (also after a crash); leave the machine's servers."""
    from cli.stack import STATE_FILE

    directory = state_dir()
    stack = _load(directory)
    if stack is None:
        console.print(f"nothing is running (no stack recorded in {directory / STATE_FILE})")
        return
    if stack.supervisor_alive() and stack.supervisor:
        # The foreground `qm up` stops its own stack; give it the time to do so.
        os.kill(int(stack.supervisor["pid"]), signal.SIGTERM)
        deadline = time.monotonic() + timeout + 15
        while (directory / STATE_FILE).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        stack = _load(directory)
    if stack is not None:
        killed = stack.stop(timeout, on_step=lambda msg: console.print(f"[dim]{msg}[/dim]"))
        if killed:
            console.print(f"[yellow]had to kill pids {killed}[/yellow]")
        if left := stack.alive():
            _fail(f"still running after stop: {', '.join(left)}")
    console.print("stopped")


def _health(client: httpx.Client, url: str) -> str:
    import httpx

    try:
        return "ok" if client.get(url).status_code == 200 else "unhealthy"
    except httpx.HTTPError:
        return "no answer"


@app.command()
def ps() -> None:
    """Show the stack's services and servers: pid, port, process state and health."""
    import httpx

    from cli import render
    from cli.probes import redact
    from cli.processes import is_alive

    stack = _load(state_dir())
    if stack is None:
        console.print("nothing is running (qm up starts the stack)")
        return
    rows = []
    with httpx.Client(timeout=1.0) as client:
        for s in stack.services:
            running = s.running()
            rows.append(
                {
                    "name": s.name,
                    "pid": s.pid,
                    "port": s.port,
                    "log": str(s.log),
                    "process": "running" if running else "exited",
                    "health": _health(client, s.health_url) if running else "-",
                }
            )
    servers = [
        {
            "name": s.name,
            "how": s.how,
            "url": redact(s.url),
            "pid": s.pid,
            "state": ("running" if s.pid and is_alive(s.pid, s.match) else "exited")
            if s.owned
            else "not ours",
        }
        for s in stack.servers
    ]
    console.print(render.services_table(rows))
    console.print(render.servers_table(servers))
    console.print(f"gateway {stack.gateway_url}   token {stack.token}", highlight=False)


def _log_path(name: str) -> Path:
    directory = state_dir()
    stack = _load(directory)
    known = {s.name: s.log for s in (stack.services if stack else [])}
    known.update({s.name: s.log for s in (stack.servers if stack else []) if s.log})
    path = known.get(name) or directory / "logs" / f"{name}.log"
    if not path.exists():
        available = sorted(set(known) | {p.stem for p in (directory / "logs").glob("*.log")})
        _fail(f"no log for {name!r}; known: {', '.join(available) or 'none'}")
    return path


@app.command()
@click.argument("service")
@click.option("--follow", "-f", is_flag=True, help="Keep printing.")
@click.option("--lines", "-n", type=int, default=100, help="Last N lines; 0 = all.")
def logs(service: str, follow: bool, lines: int) -> None:
    """Print the log of SERVICE (gateway, queue, ... or a server): the last lines; -f to follow
    it."""
    path = _log_path(service)
    text = path.read_bytes().decode(errors="replace").splitlines()
    for line in text[-lines:] if lines else text:
        print(line)
    if follow:
        with contextlib.suppress(KeyboardInterrupt):
            _follow(path)


def _follow(path: Path) -> None:
    """Print what is appended to ``path``; start over when a new `qm up` recreates it."""
    log = path.open("rb")
    log.seek(0, os.SEEK_END)
    try:
        while True:
            if chunk := log.read():
                print(chunk.decode(errors="replace"), end="", flush=True)
                continue
            time.sleep(0.25)
            try:
                replaced = path.stat().st_ino != os.fstat(log.fileno()).st_ino
            except FileNotFoundError:
                continue  # between the old file's removal and the new one's creation
            if replaced:
                log.close()
                log = path.open("rb")
    finally:
        log.close()


if __name__ == "__main__":
    app()
