"""The `qm` command: the dev stack (up, down, ps, logs) and the job commands, wired together.

`qm` should start quickly, and most commands only talk to the gateway: the dev stack's machinery
(cli.stack and what it imports), httpx and the simulator's modules are imported inside the
commands that use them. tests/unit/cli/test_startup.py keeps it that way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console

from cli import fleet as fleet_command
from cli import jobs, render
from cli import pools as pools_command
from cli import robots as robots_command
from cli import services as services_command
from cli import traces as trace_command
from cli import usage as usage_command
from cli.client import state_dir
from cli.errors import QmError, StackError
from cli.faults import fault_app

if TYPE_CHECKING:
    import httpx
    from rich.panel import Panel

    from cli.stack import Stack

app = typer.Typer(
    name="qm",
    help="Quartermaster: schedule ML jobs on a fleet of accelerator clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
console = Console()
errors = Console(stderr=True)


def _fail(message: str, code: int = 1) -> NoReturn:
    errors.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


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
def up(
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Return, leave it running.")
    ] = False,
    port: Annotated[int, typer.Option(help="Gateway (REST API) port.")] = 8080,
    time_scale: Annotated[float, typer.Option(help="Virtual seconds per real second.")] = 60.0,
    fleet: Annotated[Path, typer.Option(help="Fleet file.")] = Path("examples/fleet.yaml"),
    policy: Annotated[Path, typer.Option(help="Policy file.")] = Path("examples/policy.yaml"),
    auth: Annotated[Path, typer.Option(help="Auth (tokens) file.")] = Path("examples/auth.yaml"),
    keep_data: Annotated[
        bool, typer.Option(help="Keep the database even when the broker starts empty.")
    ] = False,
    trace: Annotated[
        bool, typer.Option(help="Write every job's trace under the state directory (qm trace).")
    ] = True,
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
def down(
    timeout: Annotated[float, typer.Option(help="Seconds before SIGKILL.")] = 10.0,
) -> None:
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
def logs(
    service: Annotated[str, typer.Argument(help="Service (gateway, queue, …) or server.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing.")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Last N lines; 0 = all.")] = 100,
) -> None:
    """Print a service's log (the last lines; -f to follow it)."""
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


# Registered last so that `qm --help` lists the stack commands first.
jobs.register(app)
app.command("usage")(usage_command.usage)
app.command("pools")(pools_command.pools)
fleet_command.register(app)
services_command.register(app)
robots_command.register(app)
trace_command.register(app)
app.add_typer(fault_app, name="fault")

try:  # the simulator is optional: `qm` works without it (sim.cli defers its heavy imports)
    from sim.cli import sim_app  # type: ignore[import-not-found, unused-ignore]
except ImportError:
    pass
else:
    app.add_typer(sim_app, name="sim", help="Run the simulator on the scheduling core.")


if __name__ == "__main__":
    app()
