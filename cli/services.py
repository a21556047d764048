"""The inference-service commands of `qm`, over the gateway's `/v1/services` API:

- ``qm serve -f FILE``: declare the service(s) in a YAML file (a new `version` rolls out);
- ``qm services [NAME]``: every service as a table, or one (replicas, endpoints, rollout,
  history); ``--endpoints`` prints only the addresses ready to serve;
- ``qm scale NAME --min N --max M`` or ``--replicas N``;
- ``qm rollout status|pause|resume|undo NAME``;
- ``qm unserve NAME``: delete a service (every replica stops; the name is free again).

The gateway accepts a command (202) before the serving service applies it; one that cannot
apply (say, pausing when no rollout is under way) shows up as the service's last change,
`refused`, with its reason, which `qm services NAME` and `qm rollout status NAME` print.

Nothing heavy is imported here (no schemas, no httpx, no yaml at import time): `qm --help`
must stay quick (tests/unit/cli/test_startup.py). The field names checked in service files are
kept equal to schemas.serving's by tests/unit/cli/test_services.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import click
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from cli import out
from cli.client import GatewayClient, resolve_connection
from cli.errors import GatewayError, QmError
from cli.jobs import _jsonable
from cli.out import when
from cli.params import OrderedGroup, gateway_options, json_option, path_type
from cli.render import SafeTable

if TYPE_CHECKING:
    from cli.client import Response

console = Console()

# The fields of a service file (schemas.serving.ServiceSpec, its Resources and RolloutPolicy).
# The gateway ignores fields it does not know, so a typo (`max_replica: 6`) would silently
# serve the default; `qm serve` refuses it instead.
SPEC_FIELDS = frozenset(
    {
        "name",
        "tenant",
        "project",
        "user",
        "queue",
        "model",
        "version",
        "image",
        "command",
        "resources",
        "labels",
        "priority_class",
        "min_replicas",
        "max_replicas",
        "target_rps",
        "latency_slo_ms",
        "scale_down_after_s",
        "rollout",
        "drain_s",
    }
)
RESOURCE_FIELDS = frozenset(
    {"accelerators", "accelerator_types", "accelerator_memory_gb", "cpu", "memory_gb"}
)
ROLLOUT_FIELDS = frozenset({"max_surge", "max_unavailable", "ready_timeout_s"})
# Text fields a YAML author may write unquoted as numbers (`version: 2`, `user: 1234`).
TEXT_FIELDS = ("name", "tenant", "project", "user", "queue", "model", "version", "image")

PHASE_STYLES = {
    "steady": "green",
    "rolling": "yellow",
    "rolling_back": "bold red",
    "paused": "magenta",
    "deleted": "dim",
}
REPLICA_STYLES = {"pending": "cyan", "starting": "yellow", "ready": "green", "failed": "red"}


# --- the client ----------------------------------------------------------------------------


def refusal(response: Response) -> str | None:
    """The gateway's ``{reason_code, message}`` detail (a spec or command that the gateway or
    the queue's admission refuses) as ``reason_code: message``; None for any other answer,
    which cli.client.describe_error reads."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        return None
    if not isinstance(detail, dict) or not detail.get("message"):
        return None
    code = detail.get("reason_code")
    return f"{code}: {detail['message']}" if code else str(detail["message"])


class ServiceClient(GatewayClient):
    """The gateway's service API, one method per endpoint, on the job client's connection,
    token and errors (GatewayError)."""

    @staticmethod
    def _raise_for(response: Response) -> None:
        reason = None if response.is_success else refusal(response)
        if reason is None:
            GatewayClient._raise_for(response)  # success, or an error with its hint
            return
        message = f"{response.status_code} {response.reason_phrase}: {reason}"
        raise GatewayError(message, status=response.status_code)

    @staticmethod
    def _path(name: str, *rest: str) -> str:
        return "/".join(("/v1/services", quote(name, safe=""), *rest))

    def declare(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self._call("POST", "/v1/services", json=dict(body)))

    def services(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/services").get("services", []))

    def service(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", self._path(name)))

    def endpoints(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", self._path(name, "endpoints")))

    def scale(self, name: str, counts: Mapping[str, int]) -> dict[str, Any]:
        return dict(self._call("POST", self._path(name, "scale"), json=dict(counts)))

    def rollout(self, name: str, action: str) -> dict[str, Any]:
        return dict(self._call("POST", self._path(name, "rollout", action)))

    def delete(self, name: str) -> dict[str, Any]:
        return dict(self._call("DELETE", self._path(name)))


@contextmanager
def gateway(url: str | None, token: str | None) -> Iterator[ServiceClient]:
    """A client for the command; any error becomes a message on stderr and exit code 1."""
    try:
        client = ServiceClient(resolve_connection(url, token))
        with client:
            yield client
    except QmError as exc:
        out.error(str(exc))
        raise click.exceptions.Exit(1) from exc


# --- service files -------------------------------------------------------------------------


def _unknown(fields: Mapping[str, Any], known: frozenset[str], where: str) -> list[str]:
    import difflib

    problems = []
    for key in sorted(set(fields) - known, key=str):
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        problems.append(f"unknown field {where}{key}{hint}")
    return problems


def service_body(document: Any, source: str = "service file") -> dict[str, Any]:
    """One service's fields as the JSON body of ``POST /v1/services``.

    Unknown fields are refused (the gateway would ignore them); text fields and labels
    written as YAML numbers or booleans are sent as the text the user wrote.
    """
    if not isinstance(document, dict):
        raise QmError(
            f"{source}: expected a mapping of service fields, got {type(document).__name__}"
        )
    body: dict[str, Any] = _jsonable(document)
    problems = _unknown(body, SPEC_FIELDS, "")
    for section, known in (("resources", RESOURCE_FIELDS), ("rollout", ROLLOUT_FIELDS)):
        if isinstance(body.get(section), dict):
            problems += _unknown(body[section], known, f"{section}.")
    if problems:
        name = body.get("name")
        raise QmError(f"{source}{f' ({name})' if name else ''}: " + "; ".join(problems))
    for key in TEXT_FIELDS:
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            body[key] = str(value)
    labels = body.get("labels")
    if isinstance(labels, dict):
        body["labels"] = {
            k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in labels.items()
        }
    return body


def load_service_file(path: Path) -> list[dict[str, Any]]:
    """Every service in a YAML file: one service's fields, or a list of them under
    ``services:`` (several documents separated by ``---`` are read one after the other)."""
    import yaml  # here rather than at the top: only `qm serve` reads YAML

    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise QmError(f"cannot read {path}: {exc}") from exc
    bodies: list[dict[str, Any]] = []
    for document in documents:
        if isinstance(document, dict) and "services" in document:
            listed = document["services"]
            if not isinstance(listed, list):
                raise QmError(f"{path}: `services:` must be a list of services")
            if set(document) != {"services"}:
                raise QmError(
                    f"{path}: either one service's fields or a list of services under "
                    "`services:`, not both"
                )
            bodies += [service_body(d, f"{path} services[{i}]") for i, d in enumerate(listed)]
        else:
            bodies.append(service_body(document, str(path)))
    if not bodies:
        raise QmError(f"{path} holds no service")
    return bodies


# --- how services are shown ----------------------------------------------------------------


def _cell(value: Any) -> str:
    if value is None or value == "" or value == []:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def phase_text(phase: str | None) -> Text:
    return Text(phase or "-", style=PHASE_STYLES.get(phase or "", ""))


def _version(status: Mapping[str, Any]) -> str:
    """The version, as ``from → to`` while a rollout is under way."""
    came_from = status.get("rollout_from")
    return f"{came_from} → {status.get('version')}" if came_from else _cell(status.get("version"))


def _counts(status: Mapping[str, Any]) -> str:
    return f"{_cell(status.get('ready_replicas'))}/{_cell(status.get('desired_replicas'))}"


def services_table(views: Sequence[Mapping[str, Any]]) -> Table:
    table = SafeTable(title=f"{len(views)} service(s)", title_justify="left", header_style="bold")
    for column in ("service", "tenant", "model", "version", "phase"):
        table.add_column(column, no_wrap=column in ("service", "phase"))
    table.add_column("ready/desired", justify="right", no_wrap=True)
    table.add_column("min..max", justify="right")
    table.add_column("last change", no_wrap=True)
    table.add_column("reason")
    for view in views:
        s = view.get("status") or {}
        table.add_row(
            _cell(s.get("service")),
            _cell(s.get("tenant")),
            _cell(s.get("model")),
            _version(s),
            phase_text(s.get("phase")),
            _counts(s),
            f"{_cell(s.get('min_replicas'))}..{_cell(s.get('max_replicas'))}",
            _cell(s.get("change")),
            _cell(s.get("reason")),
        )
    return table


def _summary(view: Mapping[str, Any]) -> Table:
    s = view.get("status") or {}
    grid = SafeTable.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    version = _cell(s.get("version"))
    if s.get("previous_version"):
        version += f" (previous {s['previous_version']})"
    rollout = "-"
    if s.get("rollout_from"):
        rollout = f"{s['rollout_from']} → {s.get('version')}, started "
        rollout += when(s.get("rollout_started_at"))
    change = " ".join(p for p in (s.get("change"), s.get("reason") and f"({s['reason']})") if p)
    rows: list[tuple[str, str | Text]] = [
        ("service", _cell(s.get("service"))),
        ("tenant", _cell(s.get("tenant"))),
        ("model", _cell(s.get("model"))),
        ("version", version),
        ("phase", phase_text(s.get("phase"))),
        (
            "replicas",
            f"{_counts(s)} ready/desired, {_cell(s.get('min_replicas'))}.."
            f"{_cell(s.get('max_replicas'))}",
        ),
        ("rollout", rollout),
        ("last change", change or "-"),
        ("updated", when(view.get("at"))),
    ]
    for label, value in rows:
        grid.add_row(label, value)
    return grid


def replicas_table(replicas: Sequence[Mapping[str, Any]]) -> Table:
    table = SafeTable(title="replicas", title_justify="left", header_style="bold")
    for column in ("replica", "version", "state", "guaranteed", "cluster/node", "address"):
        table.add_column(column, no_wrap=column in ("replica", "state"))
    table.add_column("since", no_wrap=True)
    for r in replicas:
        place = "/".join(p for p in (r.get("cluster"), r.get("node")) if p)
        state = r.get("state")
        table.add_row(
            _cell(r.get("replica")),
            _cell(r.get("version")),
            Text(state or "-", style=REPLICA_STYLES.get(state or "", "")),
            "yes" if r.get("guaranteed") else "no",
            place or "-",
            _cell(r.get("address")),
            when(r.get("since")),
        )
    return table


def endpoints_table(endpoints: Sequence[Mapping[str, Any]]) -> Table:
    table = SafeTable(title="endpoints", title_justify="left", header_style="bold")
    for column in ("replica", "version", "address"):
        table.add_column(column)
    for e in endpoints:
        table.add_row(_cell(e.get("replica")), _cell(e.get("version")), _cell(e.get("address")))
    return table


def history_table(history: Sequence[Mapping[str, Any]]) -> Table:
    table = SafeTable(title="history (newest first)", title_justify="left", header_style="bold")
    table.add_column("revision", justify="right")
    table.add_column("at", no_wrap=True)
    for column in ("change", "version"):
        table.add_column(column)
    table.add_column("ready/desired", justify="right")
    table.add_column("reason")
    for h in history:
        table.add_row(
            _cell(h.get("revision")),
            when(h.get("at")),
            _cell(h.get("change")),
            _cell(h.get("version")),
            f"{_cell(h.get('ready_replicas'))}/{_cell(h.get('desired_replicas'))}",
            _cell(h.get("reason")),
        )
    return table


def service_view(view: Mapping[str, Any]) -> Group:
    s = view.get("status") or {}
    return Group(
        _summary(view),
        Text(),
        replicas_table(s.get("replicas") or []),
        endpoints_table(s.get("endpoints") or []),
        history_table(view.get("history") or []),
    )


def per_version(status: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """(version, ready, replicas) for each version: the one rolled out to first, then the one
    it replaces, then any other still running."""
    replicas = status.get("replicas") or []
    total = Counter(str(r.get("version")) for r in replicas)
    ready = Counter(str(r.get("version")) for r in replicas if r.get("state") == "ready")
    first = [str(v) for v in (status.get("version"), status.get("rollout_from")) if v]
    order = list(dict.fromkeys(first)) + sorted(set(total) - set(first))
    return [(v, ready[v], total[v]) for v in order]


def rollout_view(status: Mapping[str, Any]) -> Table:
    grid = SafeTable.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("service", _cell(status.get("service")))
    grid.add_row("phase", phase_text(status.get("phase")))
    if status.get("rollout_from"):
        grid.add_row("rollout", f"{status['rollout_from']} → {status.get('version')}")
        grid.add_row("started", when(status.get("rollout_started_at")))
    else:
        on = f"on {_cell(status.get('version'))}"
        if status.get("previous_version"):
            on += f" (previous {status['previous_version']}: `qm rollout undo` goes back to it)"
        grid.add_row("rollout", f"none under way; {on}")
    for i, (version, ready, count) in enumerate(per_version(status)):
        grid.add_row("ready" if i == 0 else "", f"{version}: {ready} of {count} replica(s)")
    grid.add_row("desired", _cell(status.get("desired_replicas")))
    grid.add_row("last change", _cell(status.get("change")))
    grid.add_row("reason", _cell(status.get("reason")))
    return grid


def _accepted(answer: Mapping[str, Any], name: str, follow: str) -> None:
    console.print(f"{answer.get('service', name)}  {answer.get('message', '')}", highlight=False)
    console.print(f"[dim]follow it: {follow}[/dim]", highlight=False)


def _print_json(value: Any) -> None:
    import json

    console.print_json(json.dumps(value))


# --- commands ------------------------------------------------------------------------------


@click.command()
@click.option(
    "-f",
    "--file",
    "file",
    type=path_type(exists=True, dir_okay=False),
    required=True,
    help="Service YAML file.",
)
@gateway_options
def serve(file: Path, url: str | None, token: str | None) -> None:
    """Declare the inference service(s) in a YAML file; a new version rolls out."""
    with gateway(url, token) as client:
        bodies = load_service_file(file)
        for body in bodies:
            name = str(body.get("name", "?"))
            try:
                answer = client.declare(body)
            except GatewayError as exc:
                raise GatewayError(f"{name} was not declared: {exc}", exc.status) from exc
            # The gateway's message ends with the REST route to follow; the hint below is qm's.
            message = str(answer.get("message", "")).partition("; follow it")[0]
            console.print(f"{answer.get('service', name)}  accepted  {message}", highlight=False)
    names = " ".join(str(b.get("name")) for b in bodies)
    console.print(f"[dim]follow it: qm services {names}[/dim]", highlight=False)


@click.command()
@click.argument("name", required=False)
@click.option("--endpoints", is_flag=True, help="Only the service's ready replicas and addresses.")
@json_option
@gateway_options
def services(
    name: str | None, endpoints: bool, as_json: bool, url: str | None, token: str | None
) -> None:
    """List your inference services (all tenants' for admin), or show service NAME in full."""
    if endpoints and name is None:
        raise click.BadParameter("--endpoints needs a service name", param_hint="NAME")
    with gateway(url, token) as client:
        if name is None:
            answer: dict[str, Any] = {"services": client.services()}
        else:
            answer = client.endpoints(name) if endpoints else client.service(name)
    if as_json:
        _print_json(answer)
    elif name is None:
        console.print(services_table(answer["services"]))
    elif endpoints:
        # One line per ready replica, tab-separated, for scripts and routers.
        for e in answer.get("endpoints") or []:
            print(f"{e.get('replica')}\t{e.get('version')}\t{e.get('address')}")
    else:
        console.print(service_view(answer))


@click.command()
@click.argument("name")
@click.option("--min", "low", type=click.IntRange(min=1), help="Fewest replicas.")
@click.option("--max", "high", type=click.IntRange(min=1), help="Most replicas.")
@click.option("--replicas", type=click.IntRange(min=1), help="A fixed count (min = max).")
@gateway_options
def scale(
    name: str,
    low: int | None,
    high: int | None,
    replicas: int | None,
    url: str | None,
    token: str | None,
) -> None:
    """Change service NAME's replica range (--min/--max) or fix its count (--replicas)."""
    if replicas is not None and (low is not None or high is not None):
        raise click.BadParameter("give --replicas, or --min and/or --max, not both")
    if replicas is None and low is None and high is None:
        raise click.BadParameter("give --min and/or --max, or --replicas")
    if low is not None and high is not None and low > high:
        raise click.BadParameter(f"--min {low} is above --max {high}")
    counts = {"min_replicas": low, "max_replicas": high, "replicas": replicas}
    with gateway(url, token) as client:
        answer = client.scale(name, {k: v for k, v in counts.items() if v is not None})
    _accepted(answer, name, f"qm services {name}")


@click.command()
@click.argument("name")
@gateway_options
def unserve(name: str, url: str | None, token: str | None) -> None:
    """Delete inference service NAME: every replica stops (after draining); the name is
    free."""
    with gateway(url, token) as client:
        answer = client.delete(name)
    _accepted(answer, name, "qm services")


@click.group(cls=OrderedGroup)
def rollout() -> None:
    """A service's rolling update: status, pause, resume, undo."""


@rollout.command("status")
@click.argument("name")
@json_option
@gateway_options
def rollout_status(name: str, as_json: bool, url: str | None, token: str | None) -> None:
    """Where service NAME's rollout is: phase, from and to, ready replicas per version, why."""
    with gateway(url, token) as client:
        status = client.service(name).get("status") or {}
    if as_json:
        _print_json(status)
    else:
        console.print(rollout_view(status))


def _rollout(action: str, name: str, url: str | None, token: str | None) -> None:
    with gateway(url, token) as client:
        answer = client.rollout(name, action)
    _accepted(answer, name, f"qm rollout status {name}")


@rollout.command("pause")
@click.argument("name")
@gateway_options
def rollout_pause(name: str, url: str | None, token: str | None) -> None:
    """Stop the rollout under way where it is (scaling goes on)."""
    _rollout("pause", name, url, token)


@rollout.command("resume")
@click.argument("name")
@gateway_options
def rollout_resume(name: str, url: str | None, token: str | None) -> None:
    """Go on with a paused rollout."""
    _rollout("resume", name, url, token)


@rollout.command("undo")
@click.argument("name")
@gateway_options
def rollout_undo(name: str, url: str | None, token: str | None) -> None:
    """Go back to the previous version, by the same rolling update."""
    _rollout("undo", name, url, token)
