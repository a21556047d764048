"""The robot-fleet commands (`qm robots`, `qm deploy`, `qm deployments`, `qm deployment …`,
`qm fault robot`) against fakes of the gateway's `/v1/robots` and `/v1/deployments` API and of
the edge executors.

The gateway fake answers as services/gateway/robots.py does: bodies are checked with the real
DeclareDeployment, PinBody and DeploymentCommand, tenants and roles come from the dev tokens
(examples/auth.yaml, services.gateway.auth), selectors are parsed by RobotSelector, and the
views it returns are the real RobotList and DeploymentView. `qm fault robot` talks to real edge
executor apps (services.executor.edge.app, without their Kafka and Redis loops).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from click.testing import CliRunner
from fastapi import FastAPI
from pydantic import TypeAdapter, ValidationError

from cli import robots as robots_cli
from cli.main import app
from cli.stack import Service, Stack
from schemas.bounds import NAME_PATTERN
from schemas.robots import (
    DeploymentAction,
    DeploymentCommand,
    DeploymentName,
    DeploymentStatus,
    RobotDeploymentSpec,
    RobotInventory,
    RobotSelector,
    RobotState,
)
from schemas.validation import describe_validation_error
from services.executor.edge.app import EdgeSettings, create_app
from services.gateway.auth import Principal, load_tokens
from services.gateway.robots import (
    Accepted,
    DeclareDeployment,
    DeploymentHistory,
    DeploymentView,
    PinBody,
    RobotList,
    RobotView,
)
from tests.unit.cli.gateway_double import serving
from tests.unit.cli.test_startup import HEAVY, REQUEST_ONLY, among, loaded_after

ROOT = Path(__file__).resolve().parents[3]
TOKENS = load_tokens(ROOT / "examples" / "auth.yaml")
AT = datetime(2024, 5, 1, 10, 0, tzinfo=UTC)


def problem(exc: ValidationError) -> httpx.Response:
    """FastAPI's 422 for a body or path that fails validation: each field and why."""
    fields = [
        {"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]}
        for e in exc.errors(include_url=False, include_context=False, include_input=False)
    ]
    return httpx.Response(422, json={"detail": fields})


def robot(robot_id: str, site: str, online: bool = True, **over: Any) -> RobotState:
    fields: dict[str, Any] = {
        "robot": robot_id,
        "site": site,
        "accelerator_type": "Jetson-Orin",
        "labels": {"robot_model": "mk2" if site == "lab-a" else "mk1"},
        "online": online,
        "last_seen": AT,
        **over,
    }
    return RobotState.model_validate(fields)


def verdict(healthy: bool, version: str = "v2", detail: str = "") -> dict[str, Any]:
    return {
        "model": "detector",
        "version": version,
        "healthy": healthy,
        "since": AT,
        "error_rate": 0.0 if healthy else 0.4,
        "detail": detail,
    }


INVENTORIES = [
    RobotInventory(
        cluster="robots",
        robots=[
            robot(
                "lab-a-000",
                "lab-a",
                running={"detector": "v2", "planner": "v7"},
                health=[verdict(True)],
            ),
            robot(
                "lab-a-001",
                "lab-a",
                running={"detector": "v2"},
                health=[verdict(False, detail="fault injected: inference errors")],
            ),
            robot("lab-a-002", "lab-a", online=False, running={"detector": "v1"}),
            robot("lab-b-000", "lab-b", running={"detector": "v1"}, health=[verdict(True, "v1")]),
        ],
    ),
    RobotInventory(cluster="field", robots=[robot("yard-000", "yard", online=False)]),
]


def status(name: str, **over: Any) -> DeploymentStatus:
    """A deployment's status as the serving service publishes it."""
    fields: dict[str, Any] = {
        "deployment": name,
        "tenant": "vision",
        "model": "detector",
        "version": "v2",
        "previous_version": "v1",
        "phase": "rolling",
        "wave": 1,
        "waves": 4,
        "selected": 24,
        "online": 17,
        "on_version": 3,
        "pinned": 1,
        "started_at": AT,
        "reason": "wave 1 of 4: soaking",
        "revision": 4,
        **over,
    }
    return DeploymentStatus.model_validate(fields)


class FakeGateway:
    """The gateway's robot and deployment routes over in-memory projections; records every
    request, every deployment declared and every command published."""

    def __init__(self) -> None:
        self.inventories = list(INVENTORIES)
        self.views: dict[str, DeploymentView] = {}
        self.requests: list[httpx.Request] = []
        self.declared: list[RobotDeploymentSpec] = []
        self.commands: list[DeploymentCommand] = []

    def add(self, s: DeploymentStatus, history: list[DeploymentHistory] | None = None) -> None:
        self.views[s.deployment] = DeploymentView(status=s, at=AT, history=history or [])

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        who = TOKENS.get(token)
        if who is None:
            return httpx.Response(401, json={"detail": "unknown token"})
        method, path = request.method, request.url.path
        body = json.loads(request.content) if request.content else None
        if (method, path) == ("GET", "/v1/robots"):
            return self.robots(request.url.params.get("to"))
        if (method, path) == ("POST", "/v1/deployments"):
            return self.declare(body, who)
        if (method, path) == ("GET", "/v1/deployments"):
            seen = [v for _, v in sorted(self.views.items()) if who.can_read(v.status.tenant)]
            return httpx.Response(
                200, json={"deployments": [v.model_dump(mode="json") for v in seen]}
            )
        match = re.fullmatch(r"/v1/deployments/([^/]+)(?:/([^/]+))?", path)
        if match is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        name, action = match.group(1), match.group(2)
        try:
            TypeAdapter(DeploymentName).validate_python(name)
        except ValidationError as exc:
            return problem(exc)
        if (method, action) == ("GET", None):
            view = self.views.get(name)
            if view is None or not who.can_read(view.status.tenant):
                return httpx.Response(
                    404, json={"detail": f"no deployment {name} visible to this token"}
                )
            return httpx.Response(200, json=view.model_dump(mode="json"))
        if method != "POST" or action is None:
            return httpx.Response(405, json={"detail": "Method Not Allowed"})
        if action in ("pin", "unpin"):
            try:
                pin = PinBody.model_validate(body)
            except ValidationError as exc:
                return problem(exc)
            if action == "pin" and pin.version is None:
                return httpx.Response(422, json={"detail": "pin needs the version the robot keeps"})
            extra = {"robot": pin.robot, "version": pin.version} if action == "pin" else {}
            return self.command(name, action, who, **({"robot": pin.robot} | extra))
        if action not in ("pause", "resume", "undo"):
            detail = f"no deployment action {action!r}: pause, resume or undo"
            return httpx.Response(404, json={"detail": detail})
        return self.command(name, action, who)

    def robots(self, to: str | None) -> httpx.Response:
        try:
            selector = RobotSelector.parse(to) if to else RobotSelector()
        except (ValueError, ValidationError) as exc:
            return httpx.Response(422, json={"detail": f"selector: {exc}"})
        listed = [
            RobotView(cluster=inv.cluster, **r.model_dump())
            for inv in sorted(self.inventories, key=lambda i: i.cluster)
            for r in inv.robots
            if selector.matches(inv.cluster, r)
        ]
        answer = RobotList(
            robots=listed, online=sum(1 for r in listed if r.online), total=len(listed)
        )
        return httpx.Response(200, json=answer.model_dump(mode="json"))

    def declare(self, body: Any, who: Principal) -> httpx.Response:
        try:
            declared = DeclareDeployment.model_validate(body)
        except ValidationError as exc:
            return problem(exc)
        tenant = declared.tenant or who.tenant
        if not who.can_change(tenant):
            return httpx.Response(403, json={"detail": f"cannot deploy for tenant {tenant!r}"})
        spec = RobotDeploymentSpec.model_validate({**declared.model_dump(), "tenant": tenant})
        view = self.views.get(spec.name)
        if view is not None and view.status.tenant != tenant:
            return httpx.Response(
                409, json={"detail": f"the deployment name {spec.name!r} is taken"}
            )
        if view is not None and view.status.model != spec.model:
            detail = f"deployment {spec.name!r} deploys another model; pick another name"
            return httpx.Response(409, json={"detail": detail})
        self.declared.append(spec)
        answer = Accepted(
            deployment=spec.name,
            action="deploy",
            message=f"{spec.model}:{spec.version} to the robots selected, canary "
            f"{spec.canary_share:.0%} first; follow it with GET /v1/deployments/{spec.name}",
        )
        return httpx.Response(202, json=answer.model_dump())

    def command(self, name: str, action: str, who: Principal, **extra: Any) -> httpx.Response:
        view = self.views.get(name)
        if view is None or not who.can_read(view.status.tenant):
            return httpx.Response(
                404, json={"detail": f"no deployment {name} visible to this token"}
            )
        if not who.can_change(view.status.tenant):
            return httpx.Response(403, json={"detail": "this token cannot change deployments"})
        try:
            command = DeploymentCommand(
                deployment=name,
                tenant=view.status.tenant,
                action=action,  # type: ignore[arg-type]
                requested_by=who.tenant,
                **extra,
            )
        except ValidationError as exc:
            detail = {"reason_code": "invalid_command", "message": describe_validation_error(exc)}
            return httpx.Response(422, json={"detail": detail})
        self.commands.append(command)
        answer = Accepted(deployment=name, action=action, message=f"{action} sent")
        return httpx.Response(202, json=answer.model_dump())


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGateway]:
    """The robot commands talk to a FakeGateway behind a real HTTP server (and read no
    recorded stack)."""
    gateway = FakeGateway()
    monkeypatch.setenv("QM_STATE_DIR", "/nonexistent")
    monkeypatch.setenv("QM_TOKEN", "dev-vision")
    monkeypatch.setenv("COLUMNS", "220")
    with serving(gateway) as double:
        monkeypatch.setenv("QM_GATEWAY_URL", double.url)
        yield gateway


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def sent(gateway: FakeGateway) -> list[tuple[str, str, Any]]:
    return [
        (r.method, r.url.path, json.loads(r.content) if r.content else None)
        for r in gateway.requests
    ]


def flat(output: str) -> str:
    """Output with rich's boxes and wrapping undone, for messages in an error panel."""
    return " ".join(output.replace("│", " ").split())


def row(output: str, first: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(f"│ {first} "))


# --- what is checked before asking ---------------------------------------------------------


def test_the_clients_checks_are_the_schemas() -> None:
    assert robots_cli.NAME_PATTERN == NAME_PATTERN
    defaults = RobotDeploymentSpec.model_fields
    assert defaults["canary_share"].default == robots_cli.CANARY_SHARE
    assert defaults["wave_share"].default == robots_cli.WAVE_SHARE
    assert defaults["soak_s"].default == robots_cli.SOAK_S
    assert set(robots_cli.ACTIONS) == {a.value for a in DeploymentAction}


@pytest.mark.parametrize(
    ("model", "name"),
    [
        ("detector", "detector"),
        ("YOLO_v8.nano", "yolo-v8-nano"),
        ("Grasp-Net--2", "grasp-net-2"),
        ("A" * 62 + ".", "a" * 62),
        ("9lives", "9lives"),
    ],
)
def test_the_default_name_is_the_models_as_a_dns_label(model: str, name: str) -> None:
    assert re.fullmatch(NAME_PATTERN, model)  # a model name the gateway takes
    assert robots_cli.deployment_name(model) == name
    assert TypeAdapter(DeploymentName).validate_python(name) == name


# --- qm deploy -----------------------------------------------------------------------------


def test_deploy_sends_model_version_and_selector(fake: FakeGateway) -> None:
    result = run("deploy", "detector:v2", "--to", "site=lab-a,robot_model=mk2")
    assert result.exit_code == 0, result.output
    ((method, path, body),) = sent(fake)
    assert (method, path) == ("POST", "/v1/deployments")
    assert body == {
        "name": "detector",
        "model": "detector",
        "version": "v2",
        "to": "site=lab-a,robot_model=mk2",
        "canary_share": 0.1,
        "wave_share": 0.3,
        "soak_s": 300.0,
        "labels": {},
    }
    (spec,) = fake.declared
    assert (spec.name, spec.tenant, spec.model, spec.version) == (
        "detector",
        "vision",
        "detector",
        "v2",
    )
    assert spec.to == RobotSelector(sites=["lab-a"], labels={"robot_model": "mk2"})
    assert "detector  accepted  detector:v2 to the robots selected, canary 10% first" in (
        result.output
    )
    assert "GET /v1" not in result.output
    assert "follow it: qm deployments detector" in result.output


def test_deploy_options_reach_the_spec(fake: FakeGateway) -> None:
    result = run(
        "deploy",
        "Grasp_Net:2024.05",
        "--to",
        "robot=lab-a-003,robot=lab-b-001",
        "--canary",
        "0.25",
        "--wave",
        "0.5",
        "--soak",
        "60",
        "--label",
        "team=perception",
        "--label",
        "sim_health=failed",
    )
    assert result.exit_code == 0, result.output
    (spec,) = fake.declared
    assert (spec.name, spec.model, spec.version) == ("grasp-net", "Grasp_Net", "2024.05")
    assert spec.to.robots == ["lab-a-003", "lab-b-001"]
    assert (spec.canary_share, spec.wave_share, spec.soak_s) == (0.25, 0.5, 60)
    assert spec.labels == {"team": "perception", "sim_health": "failed"}
    assert "canary 25% first" in result.output


def test_deploy_with_a_name_and_to_every_robot(fake: FakeGateway) -> None:
    result = run("deploy", "detector:v3", "--to", "all", "--name", "det-everywhere")
    assert result.exit_code == 0, result.output
    assert sent(fake)[0][2]["to"] == {}
    (spec,) = fake.declared
    assert spec.name == "det-everywhere" and spec.to == RobotSelector()


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("detector", "'detector': write MODEL:VERSION, e.g. detector:v2"),
        ("detector:", "write MODEL:VERSION"),
        (":v2", "write MODEL:VERSION"),
        ("detector:v2:rc1", "the version must be 1 to 63 letters"),
        ("_detector:v2", "the model must be 1 to 63 letters"),
        ("det ector:v 2", "the model and version must be"),
    ],
)
def test_deploy_a_malformed_model_version_fails_before_asking(
    fake: FakeGateway, target: str, expected: str
) -> None:
    result = run("deploy", target, "--to", "site=lab-a")
    assert result.exit_code == 2
    assert expected in flat(result.output)
    assert fake.requests == []


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--to", "lab-a"], "'lab-a': write key=value, e.g. site=lab-a,robot_model=mk2"),
        (["--to", "site=lab-a,=mk2"], "'=mk2': write key=value"),
        (["--to", " , "], "an empty selector; `--to all` selects every robot"),
        (["--to", "site=lab-a", "--label", "team"], "'team': write key=value"),
        (["--to", "site=lab-a", "--label", "a=1", "--label", "a=2"], "label a given twice"),
        (["--to", "site=lab-a", "--canary", "0"], "0 is not a share of the robots"),
        (["--to", "site=lab-a", "--wave", "1.5"], "1.5 is not a share of the robots"),
        (["--to", "site=lab-a", "--soak", "-1"], "--soak"),
        ([], "Missing option '--to'"),
    ],
)
def test_deploy_refuses_nonsense_before_asking(
    fake: FakeGateway, options: list[str], expected: str
) -> None:
    result = run("deploy", "detector:v2", *options)
    assert result.exit_code == 2
    assert expected in flat(result.output)
    assert fake.requests == []


@pytest.mark.parametrize(
    ("setup", "args", "expected"),
    [
        (
            lambda f: f.add(status("detector", model="planner")),
            ["detector:v2", "--to", "site=lab-a"],
            "409 Conflict: deployment 'detector' deploys another model; pick another name",
        ),
        (
            lambda f: f.add(status("detector", tenant="nlp")),
            ["detector:v2", "--to", "site=lab-a"],
            "409 Conflict: the deployment name 'detector' is taken",
        ),
        (
            lambda f: None,
            ["detector:v2", "--to", "site=lab a"],
            "422 Unprocessable Entity: to.sites.0: String should match pattern",
        ),
    ],
)
def test_deploy_prints_the_gateways_refusal_and_fails(
    fake: FakeGateway, setup: Any, args: list[str], expected: str
) -> None:
    setup(fake)
    result = run("deploy", *args)
    assert result.exit_code == 1
    assert "error: detector was not deployed: " in result.output
    assert expected in result.output
    assert fake.declared == []


# --- qm deployments ------------------------------------------------------------------------


def test_deployments_table(fake: FakeGateway) -> None:
    fake.add(status("detector"))
    fake.add(
        status(
            "planner",
            model="planner",
            version="v7",
            previous_version=None,
            phase="done",
            wave=3,
            waves=3,
            selected=16,
            online=12,
            on_version=12,
            reason="every wave reached",
        )
    )
    fake.add(status("theirs", tenant="nlp"))
    result = run("deployments")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("GET", "/v1/deployments", None)]
    assert "2 deployment(s)" in result.output.splitlines()[0]
    assert "theirs" not in result.output
    detector = row(result.output, "detector")
    cells = [c.strip() for c in detector.strip("│").split("│")]
    assert cells[:10] == [
        "detector",
        "vision",
        "detector",
        "v2",
        "v1",
        "rolling",
        "1/4",
        "3/24",
        "17",
        "wave 1 of 4: soaking",
    ]
    planner = [c.strip() for c in row(result.output, "planner").strip("│").split("│")]
    assert planner[3:9] == ["v7", "-", "done", "3/3", "12/16", "12"]


def test_deployments_as_admin_see_every_tenant(fake: FakeGateway) -> None:
    fake.add(status("detector"))
    fake.add(status("theirs", tenant="nlp"))
    result = run("deployments", "--token", "dev-admin")
    assert result.exit_code == 0, result.output
    assert "theirs" in result.output and "2 deployment(s)" in result.output


def test_one_deployment_with_its_history(fake: FakeGateway) -> None:
    history = [
        DeploymentHistory(
            revision=r, phase=p, version="v2", wave=w, waves=4, on_version=n, reason=why, at=AT
        )
        for r, p, w, n, why in (
            (4, "rolling", 1, 3, "wave 1 of 4: soaking"),
            (3, "paused", 0, 1, "paused by vision"),
            (2, "rolling", 0, 1, "canary: 1 robot"),
        )
    ]
    fake.add(status("detector"), history)
    result = run("deployments", "detector")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("GET", "/v1/deployments/detector", None)]
    out = result.output
    assert re.search(r"version\s+v2 \(previous v1\)", out)
    assert re.search(r"phase\s+rolling", out)
    assert re.search(r"wave\s+1 of 4", out)
    assert re.search(r"robots\s+3 of 24 selected on v2, 17 online, 1 pinned", out)
    assert re.search(r"reason\s+wave 1 of 4: soaking", out)
    paused = next(line for line in out.splitlines() if "paused by vision" in line)
    assert re.search(r"│\s+3 │.*│ paused\s+│ v2\s+│\s+0/4 │\s+1 │", paused), paused
    revisions = [int(m) for m in re.findall(r"^│\s+(\d) │", out, flags=re.MULTILINE)]
    assert revisions == [4, 3, 2]


def test_deployments_json_is_the_gateways_answer(fake: FakeGateway) -> None:
    fake.add(status("detector"))
    result = run("deployments", "detector", "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)
    assert DeploymentView.model_validate(answer).status == status("detector")


def test_an_action_as_a_name_hints_at_the_action_command(fake: FakeGateway) -> None:
    result = run("deployments", "pause")
    assert result.exit_code == 1
    assert "404 Not Found: no deployment pause visible to this token" in result.output
    assert "hint: to pause a deployment: qm deployment pause NAME" in result.output


def test_a_deployment_not_visible_is_a_404_without_hint(fake: FakeGateway) -> None:
    fake.add(status("theirs", tenant="nlp"))
    result = run("deployments", "theirs")
    assert result.exit_code == 1
    assert "404 Not Found: no deployment theirs visible to this token" in result.output
    assert "hint" not in result.output


# --- qm deployment pause|resume|undo|pin|unpin ---------------------------------------------


@pytest.mark.parametrize("action", ["pause", "resume", "undo"])
def test_actions_post_to_their_path(fake: FakeGateway, action: str) -> None:
    fake.add(status("detector"))
    result = run("deployment", action, "detector")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("POST", f"/v1/deployments/detector/{action}", None)]
    ((command),) = fake.commands
    assert (command.deployment, command.action.value, command.robot) == ("detector", action, None)
    assert f"detector  {action} sent" in result.output
    assert "follow it: qm deployments detector" in result.output


def test_pin_sends_robot_and_version(fake: FakeGateway) -> None:
    fake.add(status("detector"))
    result = run("deployment", "pin", "detector", "lab-a-003", "v1")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [
        ("POST", "/v1/deployments/detector/pin", {"robot": "lab-a-003", "version": "v1"})
    ]
    (command,) = fake.commands
    assert (command.action.value, command.robot, command.version) == ("pin", "lab-a-003", "v1")
    assert "detector  pin sent" in result.output


def test_unpin_sends_the_robot(fake: FakeGateway) -> None:
    fake.add(status("detector"))
    result = run("deployment", "unpin", "detector", "lab-a-003")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("POST", "/v1/deployments/detector/unpin", {"robot": "lab-a-003"})]
    (command,) = fake.commands
    assert (command.action.value, command.robot, command.version) == ("unpin", "lab-a-003", None)


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        (["pin", "detector", "lab-a-003"], 2, "Missing argument"),
        (["pin", "detector", "lab-a-003", "v 1"], 2, "'v 1' is not a version name"),
        (["pin", "detector", "lab a", "v1"], 1, "robot: String should match pattern"),
        (["undo", "nope"], 1, "404 Not Found: no deployment nope visible to this token"),
        (["pause", "Bad_Name"], 1, "String should match pattern"),
    ],
)
def test_a_command_that_cannot_be_sent_fails(
    fake: FakeGateway, args: list[str], code: int, expected: str
) -> None:
    fake.add(status("detector"))
    result = run("deployment", *args)
    assert result.exit_code == code, result.output
    assert expected in flat(result.output)
    assert fake.commands == []


def test_a_reader_token_cannot_change_a_deployment(fake: FakeGateway) -> None:
    fake.add(status("detector"))
    result = run("deployment", "undo", "detector", "--token", "dev-ops")
    assert result.exit_code == 1
    assert "403 Forbidden" in result.output
    assert "hint: this token's tenant or role may not do that" in result.output
    assert fake.commands == []


def test_names_are_quoted_into_the_path(fake: FakeGateway) -> None:
    result = run("deployment", "undo", "detector/pause")
    assert result.exit_code == 1
    assert fake.requests[0].url.raw_path == b"/v1/deployments/detector%2Fpause/undo"


# --- qm robots -----------------------------------------------------------------------------


def test_robots_table_and_online_count(fake: FakeGateway) -> None:
    result = run("robots")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("GET", "/v1/robots", None)]
    assert fake.requests[0].url.params.get("to") is None
    out = result.output
    assert "5 robot(s)" in out.splitlines()[0]
    assert out.rstrip().splitlines()[-1] == "3 of 5 online"
    first = row(out, "lab-a-000")
    for text in ("robots", "lab-a", "online", "detector:v2, planner:v7", "healthy"):
        assert text in first, (text, first)
    sick = row(out, "lab-a-001")
    assert "unhealthy: fault injected: inference errors" in sick
    away = row(out, "lab-a-002")
    assert "offline" in away and "detector:v1" in away and away.rstrip("│ ").endswith("-")
    assert "field" in row(out, "yard-000")


def test_robots_selected(fake: FakeGateway) -> None:
    result = run("robots", "--to", "site=lab-a,robot_model=mk2")
    assert result.exit_code == 0, result.output
    assert fake.requests[0].url.params["to"] == "site=lab-a,robot_model=mk2"
    assert "lab-b-000" not in result.output and "yard-000" not in result.output
    last = result.output.rstrip().splitlines()[-1]
    assert last == "2 of 3 online (selected by site=lab-a,robot_model=mk2)"


def test_robots_to_all_asks_for_every_robot(fake: FakeGateway) -> None:
    result = run("robots", "--to", "all")
    assert result.exit_code == 0, result.output
    assert "to" not in fake.requests[0].url.params
    assert result.output.rstrip().endswith("\n3 of 5 online")


def test_robots_a_bad_selector_fails_before_asking(fake: FakeGateway) -> None:
    result = run("robots", "--to", "lab-a")
    assert result.exit_code == 2
    assert "write key=value" in flat(result.output)
    assert fake.requests == []


def test_robots_json_is_the_gateways_answer(fake: FakeGateway) -> None:
    result = run("robots", "--json", "--to", "cluster=field")
    assert result.exit_code == 0, result.output
    answer = RobotList.model_validate(json.loads(result.output))
    assert (answer.online, answer.total) == (0, 1)
    assert [r.robot for r in answer.robots] == ["yard-000"]


def test_robots_without_a_valid_token_gives_the_hint(fake: FakeGateway) -> None:
    result = run("robots", "--token", "dev-wrong")
    assert result.exit_code == 1
    assert "401 Unauthorized: unknown token" in result.output
    assert "hint: pass --token or set QM_TOKEN" in result.output


# --- qm fault robot ------------------------------------------------------------------------


FLEETS = {
    "robot_fleets": [
        {
            "name": "field",
            "kind": "edge",
            "sites": [{"site": "yard", "count": 2, "accelerator_type": "Jetson-Orin"}],
        },
        {
            "name": "robots",
            "kind": "edge",
            "sites": [{"site": "lab-a", "count": 4, "accelerator_type": "Jetson-Orin"}],
        },
    ]
}


class EdgeExecutors:
    """The stack's edge executors, real apps, behind ``httpx.post``: records every post."""

    def __init__(self, fleet_file: Path) -> None:
        self.apps: dict[int, FastAPI] = {}
        self.down: set[int] = set()
        self.posts: list[tuple[int, str, Any]] = []
        self.fleet_file = fleet_file

    def add(self, port: int, fleet: str) -> FastAPI:
        self.apps[port] = create_app(EdgeSettings(edge_fleet=fleet, fleet_file=self.fleet_file))
        return self.apps[port]

    def post(self, url: str, json: Any = None, timeout: float = 0) -> httpx.Response:
        parsed = httpx.URL(url)
        port = parsed.port or 80
        self.posts.append((port, parsed.path, json))
        if port in self.down or port not in self.apps:
            raise httpx.ConnectError("connection refused")
        return asyncio.run(self._post(self.apps[port], parsed.path, json))

    @staticmethod
    async def _post(edge: FastAPI, path: str, body: Any) -> httpx.Response:
        transport = httpx.ASGITransport(app=edge)  # no lifespan: no Kafka, no Redis
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            response = await client.post(path, json=body)
            await response.aread()
            return response


@pytest.fixture
def edges(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[EdgeExecutors]:
    """A recorded stack with two robot fleets (field on port 9001, robots on 9002) and a
    cluster executor; each edge executor a real app."""
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEETS))
    logs = tmp_path / "logs"
    Stack(
        tmp_path,
        "http://127.0.0.1:8080",
        "dev-vision",
        services=[
            Service("gateway", "services.gateway", 8080, logs / "gateway.log"),
            Service(
                "executor-c",
                "services.executor",
                9000,
                logs / "c.log",
                {"QM_EXECUTOR_CLUSTER": "c"},
            ),
            Service(
                "edge-robots",
                "services.executor.edge",
                9002,
                logs / "edge-robots.log",
                {"QM_EDGE_FLEET": "robots"},
            ),
            Service(
                "edge-field",
                "services.executor.edge",
                9001,
                logs / "edge-field.log",
                {"QM_EDGE_FLEET": "field"},
            ),
        ],
    ).save()
    monkeypatch.setenv("QM_STATE_DIR", str(tmp_path))
    executors = EdgeExecutors(fleet_file)
    executors.add(9001, "field")
    executors.add(9002, "robots")
    monkeypatch.setattr(httpx, "post", executors.post)
    yield executors


def test_fault_robot_reaches_the_fleet_that_has_it(edges: EdgeExecutors) -> None:
    result = run("fault", "robot", "lab-a-003", "--offline", "--unhealthy")
    assert result.exit_code == 0, result.output
    body = {"robot": "lab-a-003", "link": "offline", "health": "unhealthy"}
    # field (sorted first) does not know it, robots does; the cluster executor is not asked.
    assert edges.posts == [(9001, "/faults/robot", body), (9002, "/faults/robot", body)]
    sim = edges.apps[9002].state.robots["lab-a-003"]
    assert sim.link_down and sim.sick
    assert "'link_down': True" in result.output and "'sick': True" in result.output


def test_fault_robot_back_online_and_healthy(edges: EdgeExecutors) -> None:
    assert run("fault", "robot", "yard-001", "--offline", "--unhealthy").exit_code == 0
    result = run("fault", "robot", "yard-001", "--online")
    assert result.exit_code == 0, result.output
    assert edges.posts[-1] == (
        9001,
        "/faults/robot",
        {"robot": "yard-001", "link": "online", "health": None},
    )
    sim = edges.apps[9001].state.robots["yard-001"]
    assert not sim.link_down and sim.sick  # health left as it was
    assert run("fault", "robot", "yard-001", "--healthy").exit_code == 0
    assert not sim.sick
    assert [port for port, _, _ in edges.posts] == [9001, 9001, 9001]  # found at once


def test_fault_robot_without_an_option_fails_before_asking(edges: EdgeExecutors) -> None:
    result = run("fault", "robot", "lab-a-003")
    assert result.exit_code == 2
    assert "give --offline or --online, and/or --unhealthy or --healthy" in flat(result.output)
    assert edges.posts == []


def test_fault_robot_no_fleet_knows(edges: EdgeExecutors) -> None:
    result = run("fault", "robot", "lab-z-999", "--offline")
    assert result.exit_code == 2
    assert "no robot fleet of this stack (field, robots) has a robot lab-z-999" in flat(
        result.output
    )
    assert [port for port, _, _ in edges.posts] == [9001, 9002]


def test_fault_robot_says_which_edge_executor_did_not_answer(edges: EdgeExecutors) -> None:
    edges.down.add(9002)
    result = run("fault", "robot", "lab-a-003", "--offline")
    assert result.exit_code == 2
    assert "has a robot lab-a-003; the edge executor of robots did not answer (qm ps)" in flat(
        result.output
    )


def test_fault_robot_skips_an_executor_that_is_down(edges: EdgeExecutors) -> None:
    edges.down.add(9001)
    result = run("fault", "robot", "lab-a-001", "--unhealthy")
    assert result.exit_code == 0, result.output
    assert edges.apps[9002].state.robots["lab-a-001"].sick


def test_fault_robot_without_a_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("QM_STATE_DIR", str(tmp_path))
    result = run("fault", "robot", "lab-a-003", "--offline")
    assert result.exit_code == 2
    assert "no stack is running here" in flat(result.output)


# --- start-up ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["deploy", "--help"],
        ["robots", "--help"],
        ["deployments", "--help"],
        ["deployment", "pin", "--help"],
        ["fault", "robot", "--help"],
    ],
)
def test_the_robot_commands_keep_qm_quick(command: list[str], tmp_path: Path) -> None:
    assert among(loaded_after(command, tmp_path=tmp_path), HEAVY + REQUEST_ONLY) == []
