"""The robot-fleet commands of `qm`, over the gateway's `/v1/robots` and `/v1/deployments` API:

- ``qm robots [--to SELECTOR]``: every robot the fleets' edge executors report (link, last
  seen, the model versions it runs, its health on them) and how many are online;
- ``qm deploy MODEL:VERSION --to SELECTOR``: deploy a model version to the robots selected,
  in waves (a canary first); the same deployment again with a new version rolls that out;
- ``qm deployments [NAME]``: every deployment as a table, or one with its history;
- ``qm deployment pause|resume|undo NAME``, ``qm deployment pin NAME ROBOT VERSION``,
  ``qm deployment unpin NAME ROBOT``: change a deployment under way.

The actions are a sub-command (`qm deployment ACTION NAME`), as `qm rollout ACTION NAME` is for
services, so that `qm deployments [NAME]` keeps a free optional name.

A selector is ``key=value`` pairs joined by commas: ``site``, ``robot`` (either given twice
means any of the values), ``cluster``, and any other key a robot label
(``site=lab-a,robot_model=mk2``). `qm deploy` needs one, so that declaring a deployment again
never widens it to every robot by omission; ``--to all`` selects every robot.

Like cli.services, nothing heavy is imported here (no schemas, no httpx): `qm --help` must stay
quick (tests/unit/cli/test_startup.py). The name pattern checked here is kept equal to
schemas.bounds' by tests/unit/cli/test_robots.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import click
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from cli import services
from cli.errors import GatewayError
from cli.out import when
from cli.params import OrderedGroup, gateway_options, json_option
from cli.render import SafeTable
from cli.services import _accepted, _cell, _print_json

if TYPE_CHECKING:
    from cli.services import ServiceClient

console = Console()

# schemas.bounds.NAME_PATTERN (a model's name, a version): checked here to refuse a mistake
# before asking the gateway, without importing the schemas.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
DNS_LABEL_LENGTH = 63  # schemas.robots.DeploymentName
EVERY_ROBOT = "all"
ACTIONS = ("pause", "resume", "undo", "pin", "unpin")

# The defaults of schemas.robots.RobotDeploymentSpec (kept equal by the tests).
CANARY_SHARE = 0.1
WAVE_SHARE = 0.3
SOAK_S = 300.0
MAX_SOAK_S = 7 * 86400

DEPLOYMENT_STYLES = {
    "rolling": "yellow",
    "paused": "magenta",
    "done": "green",
    "rolled_back": "bold red",
}


# --- the client ----------------------------------------------------------------------------


class RobotClient:
    """The gateway's robot and deployment API, one method per endpoint, on a ServiceClient's
    connection, token and errors (a refusal's reason, GatewayError)."""

    def __init__(self, client: ServiceClient) -> None:
        self._call: Callable[..., Any] = client._call

    @staticmethod
    def _path(name: str, *rest: str) -> str:
        return "/".join(("/v1/deployments", quote(name, safe=""), *rest))

    def robots(self, to: str | None = None) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/robots", params={"to": to} if to else None))

    def deploy(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self._call("POST", "/v1/deployments", json=dict(body)))

    def deployments(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/v1/deployments").get("deployments", []))

    def deployment(self, name: str) -> dict[str, Any]:
        return dict(self._call("GET", self._path(name)))

    def command(
        self, name: str, action: str, body: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        kwargs = {} if body is None else {"json": dict(body)}
        return dict(self._call("POST", self._path(name, action), **kwargs))


@contextmanager
def gateway(url: str | None, token: str | None) -> Iterator[RobotClient]:
    """A client for the command; any error becomes a message on stderr and exit code 1
    (cli.services.gateway's connection and errors)."""
    with services.gateway(url, token) as client:
        yield RobotClient(client)


# --- what the user types -------------------------------------------------------------------


def _pair(text: str, option: str, example: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise click.BadParameter(f"{text!r}: write key=value, e.g. {example}", param_hint=option)
    return key.strip(), value.strip()


def selector(text: str) -> str | dict[str, Any]:
    """A selector as sent to the gateway: the text itself once its syntax is checked (the
    gateway parses it), or the empty selector (every robot) for ``all``."""
    if text.strip().lower() == EVERY_ROBOT:
        return {}
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise click.BadParameter(
            f"an empty selector; `--to {EVERY_ROBOT}` selects every robot", param_hint="--to"
        )
    for part in parts:
        _pair(part.strip(), "--to", "site=lab-a,robot_model=mk2")
    return text


def model_version(text: str) -> tuple[str, str]:
    """``MODEL:VERSION`` as (model, version), each a valid name."""
    model, sep, version = text.partition(":")
    problem = None
    if not sep or not model or not version:
        problem = "write MODEL:VERSION, e.g. detector:v2"
    else:
        bad = [w for w, v in (("model", model), ("version", version)) if not _is_name(v)]
        if bad:
            problem = (
                f"the {' and '.join(bad)} must be 1 to 63 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
    if problem:
        raise click.BadParameter(f"{text!r}: {problem}", param_hint="MODEL:VERSION")
    return model, version


def _is_name(text: str) -> bool:
    return re.fullmatch(NAME_PATTERN, text) is not None


def deployment_name(model: str) -> str:
    """A deployment's default name: its model's, as a DNS label (``YOLO_v8.nano`` ->
    ``yolo-v8-nano``)."""
    label = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return label[:DNS_LABEL_LENGTH].rstrip("-")


def labels(pairs: Sequence[str]) -> dict[str, str]:
    given: dict[str, str] = {}
    for text in pairs:
        key, value = _pair(text, "--label", "team=perception")
        if key in given:
            raise click.BadParameter(f"label {key} given twice", param_hint="--label")
        given[key] = value
    return given


def _share(value: float, option: str) -> float:
    if not 0 < value <= 1:
        raise click.BadParameter(
            f"{value:g} is not a share of the robots: above 0, at most 1", param_hint=option
        )
    return value


# --- how robots and deployments are shown --------------------------------------------------


def _online(value: Any) -> Text:
    return Text("online", style="green") if value else Text("offline", style="red")


def _running(robot: Mapping[str, Any]) -> str:
    running = robot.get("running") or {}
    return ", ".join(f"{m}:{v}" for m, v in sorted(running.items())) or "-"


def _health(robot: Mapping[str, Any]) -> Text:
    verdicts = robot.get("health") or []
    text = Text()
    for i, h in enumerate(verdicts):
        if i:
            text.append("; ")
        if len(verdicts) > 1:
            text.append(f"{h.get('model')} ")
        if h.get("healthy"):
            text.append("healthy", style="green")
            continue
        text.append("unhealthy", style="red")
        why = h.get("detail") or (
            f"error rate {h['error_rate']:.0%}" if h.get("error_rate") is not None else ""
        )
        if why:
            text.append(f": {why}")
    return text if verdicts else Text("-")


def robots_table(robots: Sequence[Mapping[str, Any]]) -> Table:
    table = SafeTable(title=f"{len(robots)} robot(s)", title_justify="left", header_style="bold")
    for column in ("robot", "cluster", "site", "link", "last seen", "running", "health"):
        table.add_column(column, no_wrap=column in ("robot", "link", "last seen"))
    for r in robots:
        table.add_row(
            _cell(r.get("robot")),
            _cell(r.get("cluster")),
            _cell(r.get("site")),
            _online(r.get("online")),
            when(r.get("last_seen")),
            _running(r),
            _health(r),
        )
    return table


def phase_text(phase: str | None) -> Text:
    return Text(phase or "-", style=DEPLOYMENT_STYLES.get(phase or "", ""))


def _of(a: Any, b: Any) -> str:
    return f"{_cell(a)}/{_cell(b)}"


def deployments_table(views: Sequence[Mapping[str, Any]]) -> Table:
    table = SafeTable(
        title=f"{len(views)} deployment(s)", title_justify="left", header_style="bold"
    )
    for column in ("deployment", "tenant", "model", "version", "previous", "phase"):
        table.add_column(column, no_wrap=column in ("deployment", "phase"))
    for column in ("wave", "on version/selected", "online"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("reason")
    for view in views:
        s = view.get("status") or {}
        table.add_row(
            _cell(s.get("deployment")),
            _cell(s.get("tenant")),
            _cell(s.get("model")),
            _cell(s.get("version")),
            _cell(s.get("previous_version")),
            phase_text(s.get("phase")),
            _of(s.get("wave"), s.get("waves")),
            _of(s.get("on_version"), s.get("selected")),
            _cell(s.get("online")),
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
    robots = (
        f"{_cell(s.get('on_version'))} of {_cell(s.get('selected'))} selected on "
        f"{_cell(s.get('version'))}, {_cell(s.get('online'))} online, "
        f"{_cell(s.get('pinned'))} pinned"
    )
    rows: list[tuple[str, str | Text]] = [
        ("deployment", _cell(s.get("deployment"))),
        ("tenant", _cell(s.get("tenant"))),
        ("model", _cell(s.get("model"))),
        ("version", version),
        ("phase", phase_text(s.get("phase"))),
        ("wave", f"{_cell(s.get('wave'))} of {_cell(s.get('waves'))}"),
        ("robots", robots),
        ("started", when(s.get("started_at"))),
        ("reason", _cell(s.get("reason"))),
        ("updated", when(view.get("at"))),
    ]
    for label, value in rows:
        grid.add_row(label, value)
    return grid


def history_table(history: Sequence[Mapping[str, Any]]) -> Table:
    table = SafeTable(title="history (newest first)", title_justify="left", header_style="bold")
    table.add_column("revision", justify="right")
    table.add_column("at", no_wrap=True)
    table.add_column("phase", no_wrap=True)
    table.add_column("version")
    table.add_column("wave", justify="right")
    table.add_column("on version", justify="right")
    table.add_column("reason")
    for h in history:
        table.add_row(
            _cell(h.get("revision")),
            when(h.get("at")),
            phase_text(h.get("phase")),
            _cell(h.get("version")),
            _of(h.get("wave"), h.get("waves")),
            _cell(h.get("on_version")),
            _cell(h.get("reason")),
        )
    return table


def deployment_view(view: Mapping[str, Any]) -> Group:
    return Group(_summary(view), Text(), history_table(view.get("history") or []))


# --- commands ------------------------------------------------------------------------------


@click.command()
@click.option("--to", help="Only these robots: site=lab-a,robot_model=mk2.")
@json_option
@gateway_options
def robots(to: str | None, as_json: bool, url: str | None, token: str | None) -> None:
    """List the robots of every robot fleet: link, versions running, health; how many online."""
    chosen = selector(to) if to is not None else {}
    query = chosen if isinstance(chosen, str) else None  # None (or `all`): every robot
    with gateway(url, token) as client:
        answer = client.robots(query)
    if as_json:
        _print_json(answer)
        return
    listed = answer.get("robots") or []
    console.print(robots_table(listed))
    online, total = answer.get("online", 0), answer.get("total", len(listed))
    where = f" (selected by {query})" if query else ""
    console.print(f"{online} of {total} online{where}", highlight=False)


@click.command()
@click.argument("target", metavar="MODEL:VERSION")
@click.option(
    "--to",
    required=True,
    help=f"Which robots: site=lab-a,robot_model=mk2 (`{EVERY_ROBOT}`: every robot).",
)
@click.option("--name", help="Deployment name (default: the model's, as a DNS label).")
@click.option(
    "--canary", type=float, default=CANARY_SHARE, help="Share of the robots in the first wave."
)
@click.option(
    "--wave", type=float, default=WAVE_SHARE, help="Share of the robots in each further wave."
)
@click.option(
    "--soak",
    type=click.FloatRange(0, MAX_SOAK_S),
    default=SOAK_S,
    help="Seconds healthy before the next wave.",
)
@click.option("--label", multiple=True, help="key=value, repeatable.")
@gateway_options
def deploy(
    target: str,
    to: str,
    name: str | None,
    canary: float,
    wave: float,
    soak: float,
    label: tuple[str, ...],
    url: str | None,
    token: str | None,
) -> None:
    """Deploy a model version (MODEL:VERSION, e.g. detector:v2) to robots, in waves gated by
    their health (a canary first).

    Deploying the same name again with a new version rolls that version out the same way."""
    model, version = model_version(target)
    body: dict[str, Any] = {
        "name": name if name is not None else deployment_name(model),
        "model": model,
        "version": version,
        "to": selector(to),
        "canary_share": _share(canary, "--canary"),
        "wave_share": _share(wave, "--wave"),
        "soak_s": soak,
        "labels": labels(label),
    }
    with gateway(url, token) as client:
        try:
            answer = client.deploy(body)
        except GatewayError as exc:
            raise GatewayError(f"{body['name']} was not deployed: {exc}", exc.status) from exc
    deployed = answer.get("deployment", body["name"])
    # The gateway's message ends with the REST route to follow; the hint below is qm's.
    message = str(answer.get("message", "")).partition("; follow it")[0]
    console.print(f"{deployed}  accepted  {message}", highlight=False)
    console.print(f"[dim]follow it: qm deployments {deployed}[/dim]", highlight=False)


@click.command()
@click.argument("name", required=False)
@json_option
@gateway_options
def deployments(name: str | None, as_json: bool, url: str | None, token: str | None) -> None:
    """List your robot deployments (all tenants' for admin), or show deployment NAME with its
    history."""
    with gateway(url, token) as client:
        if name is None:
            answer: dict[str, Any] = {"deployments": client.deployments()}
        else:
            try:
                answer = client.deployment(name)
            except GatewayError as exc:
                if exc.status != 404 or name not in ACTIONS:
                    raise
                hint = f"\n  hint: to {name} a deployment: qm deployment {name} NAME"
                raise GatewayError(f"{exc}{hint}", exc.status) from exc
    if as_json:
        _print_json(answer)
    elif name is None:
        console.print(deployments_table(answer["deployments"]))
    else:
        console.print(deployment_view(answer))


@click.group(cls=OrderedGroup)
def deployment() -> None:
    """Change a robot deployment: pause, resume, undo; pin or unpin a robot."""


def _command(
    action: str, name: str, url: str | None, token: str | None, body: dict[str, Any] | None = None
) -> None:
    with gateway(url, token) as client:
        answer = client.command(name, action, body)
    _accepted(answer, name, f"qm deployments {name}")


@deployment.command("pause")
@click.argument("name")
@gateway_options
def deployment_pause(name: str, url: str | None, token: str | None) -> None:
    """Open no further wave of deployment NAME (the robots reached keep the new version)."""
    _command("pause", name, url, token)


@deployment.command("resume")
@click.argument("name")
@gateway_options
def deployment_resume(name: str, url: str | None, token: str | None) -> None:
    """Go on with paused deployment NAME."""
    _command("resume", name, url, token)


@deployment.command("undo")
@click.argument("name")
@gateway_options
def deployment_undo(name: str, url: str | None, token: str | None) -> None:
    """Send every robot of deployment NAME back to the previous version."""
    _command("undo", name, url, token)


@deployment.command("pin")
@click.argument("name")
@click.argument("robot")
@click.argument("version")
@gateway_options
def deployment_pin(name: str, robot: str, version: str, url: str | None, token: str | None) -> None:
    """Keep ROBOT (e.g. lab-a-003) on VERSION in deployment NAME, whatever the rollout does."""
    if not _is_name(version):
        raise click.BadParameter(f"{version!r} is not a version name", param_hint="VERSION")
    _command("pin", name, url, token, {"robot": robot, "version": version})


@deployment.command("unpin")
@click.argument("name")
@click.argument("robot")
@gateway_options
def deployment_unpin(name: str, robot: str, url: str | None, token: str | None) -> None:
    """Let pinned ROBOT follow deployment NAME's rollout again."""
    _command("unpin", name, url, token, {"robot": robot})
