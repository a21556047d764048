"""The inference-service commands (`qm serve`, `qm services`, `qm scale`, `qm rollout …`,
`qm unserve`) against a fake of the gateway's `/v1/services` API.

The fake answers as services/gateway/serving.py does: a declaration is checked with the real
ServiceSpec and the queue's admission under examples/policy.yaml (a mistake is a 422 with a
`reason_code` and a message), names and tenants come from the dev tokens, commands on a
service no token sees are 404s, and the views it returns are real ServiceStatus payloads.
"""

from __future__ import annotations

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
from pydantic import ValidationError

from cli.errors import QmError
from cli.main import app
from cli.services import (
    RESOURCE_FIELDS,
    ROLLOUT_FIELDS,
    SPEC_FIELDS,
    load_service_file,
    per_version,
)
from core.policy import Policy
from schemas.job import Resources
from schemas.serving import (
    Endpoint,
    ReplicaView,
    RolloutPolicy,
    ServiceCommand,
    ServiceSpec,
    ServiceStatus,
)
from schemas.validation import describe_validation_error
from services.common.admission import check_admission
from services.gateway.serving import DeclareService
from tests.unit.cli.gateway_double import serving
from tests.unit.cli.test_startup import HEAVY, REQUEST_ONLY, among, loaded_after

ROOT = Path(__file__).resolve().parents[3]
CHAT = ROOT / "examples" / "services" / "chat.yaml"
POLICY = Policy.from_dict(yaml.safe_load((ROOT / "examples" / "policy.yaml").read_text()))
TOKENS = {"dev-vision": "vision", "dev-nlp": "nlp"}
AT = datetime(2024, 5, 1, 10, 0, tzinfo=UTC)


def status(name: str, **over: Any) -> dict[str, Any]:
    """A service's status as the serving service publishes it (validated by the schema)."""
    fields: dict[str, Any] = {
        "service": name,
        "tenant": "vision",
        "phase": "steady",
        "model": "llama-3-8b",
        "version": "v1",
        "min_replicas": 2,
        "max_replicas": 6,
        "desired_replicas": 2,
        "ready_replicas": 2,
        "change": "declared",
        "reason": "llama-3-8b v1: 2 to 6 replica(s)",
        "revision": 1,
        **over,
    }
    return ServiceStatus.model_validate(fields).model_dump(mode="json")


def replica(n: int, version: str, state: str = "ready", **over: Any) -> dict[str, Any]:
    return ReplicaView(
        replica=f"svc-chat-{n}",
        version=version,
        state=state,
        guaranteed=n < 2,
        since=AT,
        cluster="cloud-l4",
        node=f"cloud-l4-l4-000{n}",
        address=f"10.0.0.{n}:8000" if state == "ready" else None,
        **over,
    ).model_dump(mode="json")


class FakeGateway:
    """The gateway's service routes over an in-memory projection; records every request."""

    def __init__(self) -> None:
        self.views: dict[str, dict[str, Any]] = {}
        self.requests: list[httpx.Request] = []
        self.commands: list[dict[str, Any]] = []

    def add(self, view_status: dict[str, Any], history: list[dict[str, Any]] | None = None) -> None:
        self.views[view_status["service"]] = {
            "status": view_status,
            "at": AT.isoformat(),
            "history": history or [],
        }

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        tenant = TOKENS.get(token)
        if tenant is None:
            return httpx.Response(401, json={"detail": "unknown or missing bearer token"})
        method, path = request.method, request.url.path
        body = json.loads(request.content) if request.content else {}
        if (method, path) == ("POST", "/v1/services"):
            return self.declare(body, tenant)
        if (method, path) == ("GET", "/v1/services"):
            mine = [v for _, v in sorted(self.views.items()) if v["status"]["tenant"] == tenant]
            return httpx.Response(200, json={"services": mine})
        match = re.fullmatch(r"/v1/services/([^/]+)(/.*)?", path)
        if match is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        name, rest = match.group(1), match.group(2) or ""
        view = self.views.get(name)
        if view is None or view["status"]["tenant"] != tenant:
            return httpx.Response(404, json={"detail": f"no service {name} visible to this token"})
        if (method, rest) == ("GET", ""):
            return httpx.Response(200, json=view)
        if (method, rest) == ("GET", "/endpoints"):
            return httpx.Response(
                200,
                json={"service": name, "endpoints": view["status"]["endpoints"], "at": view["at"]},
            )
        if (method, rest) == ("POST", "/scale"):
            low, high = body.get("min_replicas"), body.get("max_replicas")
            if body.get("replicas") is not None:
                if low is not None or high is not None:
                    return httpx.Response(
                        422, json={"detail": "give replicas, or min_replicas/max_replicas"}
                    )
                low = high = body["replicas"]
            return self.command(name, tenant, "scale", min_replicas=low, max_replicas=high)
        if method == "POST" and rest.startswith("/rollout/"):
            action = rest.removeprefix("/rollout/")
            if action not in ("pause", "resume", "undo"):
                detail = f"no rollout action {action!r}: pause, resume or undo"
                return httpx.Response(404, json={"detail": detail})
            return self.command(name, tenant, action)
        if (method, rest) == ("DELETE", ""):
            return self.command(name, tenant, "delete")
        return httpx.Response(405, json={"detail": "Method Not Allowed"})

    def declare(self, body: dict[str, Any], tenant: str) -> httpx.Response:
        try:  # FastAPI validates the body first: its 422 lists each field and why
            DeclareService.model_validate(body)
        except ValidationError as exc:
            fields = [
                {"loc": ["body", *e["loc"]], "msg": e["msg"], "type": e["type"]}
                for e in exc.errors(include_url=False, include_context=False, include_input=False)
            ]
            return httpx.Response(422, json={"detail": fields})
        try:
            spec = ServiceSpec.model_validate({**body, "tenant": body.get("tenant") or tenant})
        except ValidationError as exc:
            detail = {"reason_code": "invalid_spec", "message": describe_validation_error(exc)}
            return httpx.Response(422, json={"detail": detail})
        rejection = check_admission(spec.replica_job(f"svc-{spec.name}-0", guaranteed=True), POLICY)
        if rejection is not None:
            detail = {"reason_code": rejection.reason.value, "message": rejection.message}
            return httpx.Response(422, json={"detail": detail})
        message = (
            f"{spec.model} {spec.version}: {spec.min_replicas} to {spec.max_replicas} "
            f"replica(s); follow it with GET /v1/services/{spec.name}"
        )
        return httpx.Response(
            202, json={"service": spec.name, "action": "declare", "message": message}
        )

    def command(self, name: str, tenant: str, action: str, **counts: Any) -> httpx.Response:
        try:
            ServiceCommand(service=name, tenant=tenant, action=action, **counts)  # type: ignore[arg-type]
        except ValidationError as exc:
            detail = {"reason_code": "invalid_command", "message": describe_validation_error(exc)}
            return httpx.Response(422, json={"detail": detail})
        self.commands.append({"service": name, "action": action, **counts})
        return httpx.Response(
            202, json={"service": name, "action": action, "message": f"{action} sent"}
        )


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGateway]:
    """The service commands talk to a FakeGateway behind a real HTTP server (and read no
    recorded stack)."""
    gateway = FakeGateway()
    monkeypatch.setenv("QM_STATE_DIR", "/nonexistent")
    monkeypatch.setenv("QM_TOKEN", "dev-vision")
    monkeypatch.setenv("COLUMNS", "200")
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


# --- the service file ----------------------------------------------------------------------


def test_file_fields_are_the_schemas_fields() -> None:
    # qm serve refuses fields it does not know; it must know every field the gateway does.
    assert set(ServiceSpec.model_fields) == SPEC_FIELDS
    assert set(Resources.model_fields) == RESOURCE_FIELDS
    assert set(RolloutPolicy.model_fields) == ROLLOUT_FIELDS


def test_the_example_is_a_valid_admissible_service() -> None:
    (body,) = load_service_file(CHAT)
    spec = ServiceSpec.model_validate({"tenant": "vision", **body})
    assert (spec.name, spec.model, spec.version) == ("chat", "llama-3-8b", "v1")
    assert spec.resources.accelerators == 0.5
    assert spec.resources.accelerator_types == ("L4", "A100")
    assert (spec.resources.cpu, spec.resources.memory_gb) == (4, 16)
    assert (spec.min_replicas, spec.max_replicas) == (2, 6)
    assert (spec.target_rps, spec.latency_slo_ms, spec.scale_down_after_s) == (20, 300, 300)
    assert (spec.rollout.max_surge, spec.rollout.max_unavailable) == (1, 0)
    assert spec.priority_class == "high" and POLICY.priority_classes["high"].preempting
    assert set(spec.resources.accelerator_types) <= set(POLICY.accelerator_types)
    job = spec.replica_job("svc-chat-0", guaranteed=True)
    assert check_admission(job, POLICY) is None


def test_numbers_where_text_is_meant_are_sent_as_text(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("name: chat\nversion: 2\nlabels: {canary: true, build: 7}\n")
    (body,) = load_service_file(path)
    assert body == {"name": "chat", "version": "2", "labels": {"canary": "true", "build": "7"}}


def test_a_list_under_services_is_several(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("services:\n  - {name: a, version: v1}\n  - {name: b, version: v2}\n")
    assert [b["name"] for b in load_service_file(path)] == ["a", "b"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "holds no service"),
        ("name: [unclosed\n", "cannot read"),
        ("- a\n- b\n", "expected a mapping of service fields, got list"),
        ("just a string\n", "expected a mapping of service fields, got str"),
        ("services: chat\n", "`services:` must be a list"),
        ("services: [{name: a}]\nname: b\n", "not both"),
        ("services: [{name: a}, 3]\n", "services[1]: expected a mapping"),
        ("name: chat\nmax_replica: 6\n", "unknown field max_replica (did you mean max_replicas?)"),
        ("name: chat\nresources: {gpus: 1}\n", "unknown field resources.gpus"),
        ("name: chat\nrollout: {surge: 1}\n", "unknown field rollout.surge"),
    ],
)
def test_a_bad_file_is_a_clear_error(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(QmError, match=re.escape(expected)):
        load_service_file(path)


# --- qm serve ------------------------------------------------------------------------------


def test_serve_posts_the_files_fields(fake: FakeGateway) -> None:
    result = run("serve", "-f", str(CHAT))
    assert result.exit_code == 0, result.output
    ((method, path, body),) = sent(fake)
    assert (method, path) == ("POST", "/v1/services")
    assert body == yaml.safe_load(CHAT.read_text())  # every field, as written
    assert fake.requests[0].headers["Authorization"] == "Bearer dev-vision"
    assert "chat  accepted  llama-3-8b v1: 2 to 6 replica(s)" in result.output
    assert "qm services chat" in result.output


def test_serve_posts_each_service_of_a_list_in_order(fake: FakeGateway, tmp_path: Path) -> None:
    chat = yaml.safe_load(CHAT.read_text())
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump({"services": [chat, {**chat, "name": "chat-canary"}]}))
    result = run("serve", "-f", str(path))
    assert result.exit_code == 0, result.output
    assert [b["name"] for _, _, b in sent(fake)] == ["chat", "chat-canary"]
    assert "chat-canary  accepted" in result.output


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"resources": {"accelerators": 0.5, "accelerator_types": ["B200"]}},
            "422 Unprocessable Entity: unknown_accelerator_type: accelerator type(s) B200 are "
            "not in the fleet",
        ),
        ({"queue": "nope"}, "unknown_queue: queue 'nope' does not exist for tenant 'vision'"),
        (
            {"min_replicas": 5, "max_replicas": 2},
            "422 Unprocessable Entity: request: Value error, min_replicas must not be above "
            "max_replicas",
        ),
        ({"target_rps": "fast"}, "target_rps: Input should be a valid number"),
    ],
)
def test_serve_prints_the_refusals_reason_and_fails(
    fake: FakeGateway, tmp_path: Path, change: dict[str, Any], expected: str
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(CHAT.read_text()), **change}))
    result = run("serve", "-f", str(path))
    assert result.exit_code == 1
    assert "error: chat was not declared: " in result.output
    assert expected in result.output
    assert "{" not in result.output  # the reason, not the raw JSON problem body


def test_serve_a_bad_file_sends_nothing(fake: FakeGateway, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: chat\nmodel: [unclosed\n")
    result = run("serve", "-f", str(path))
    assert result.exit_code == 1
    assert f"error: cannot read {path}" in result.output
    assert fake.requests == []


def test_serve_a_missing_file_says_so(fake: FakeGateway, tmp_path: Path) -> None:
    result = run("serve", "-f", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert "does not exist" in result.output
    assert fake.requests == []


def test_serve_without_a_valid_token_gives_the_hint(fake: FakeGateway) -> None:
    result = run("serve", "-f", str(CHAT), "--token", "dev-wrong")
    assert result.exit_code == 1
    assert "401 Unauthorized: unknown or missing bearer token" in result.output
    assert "hint: pass --token or set QM_TOKEN" in result.output


# --- qm services ---------------------------------------------------------------------------


def rolling_chat() -> dict[str, Any]:
    return status(
        "chat",
        phase="rolling",
        version="v2",
        previous_version="v1",
        desired_replicas=2,
        ready_replicas=3,
        rollout_from="v1",
        rollout_started_at=AT.isoformat(),
        replicas=[
            replica(0, "v1"),
            replica(1, "v1"),
            replica(2, "v2"),
            replica(3, "v2", "starting"),
        ],
        endpoints=[
            Endpoint(replica=f"svc-chat-{n}", version=v, address=f"10.0.0.{n}:8000").model_dump()
            for n, v in ((0, "v1"), (1, "v1"), (2, "v2"))
        ],
        change="rollout_started",
        reason="rolling out v2 in place of v1",
        revision=3,
    )


def test_services_table(fake: FakeGateway) -> None:
    fake.add(rolling_chat())
    fake.add(status("embed", model="bge-large", min_replicas=1, max_replicas=3, ready_replicas=1))
    fake.add(status("theirs", tenant="nlp"))
    result = run("services")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("GET", "/v1/services", None)]
    lines = result.output.splitlines()
    assert "2 service(s)" in lines[0] and "theirs" not in result.output
    chat = next(line for line in lines if line.startswith("│ chat "))
    for text in ("vision", "llama-3-8b", "v1 → v2", "rolling", "3/2", "2..6", "rollout_started"):
        assert text in chat, (text, chat)
    assert "rolling out v2 in place of v1" in result.output
    embed = next(line for line in lines if line.startswith("│ embed "))
    for text in ("bge-large", "steady", "1/2", "1..3"):
        assert text in embed, (text, embed)


def test_services_json_is_the_gateways_answer(fake: FakeGateway) -> None:
    fake.add(rolling_chat())
    result = run("services", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["services"][0]["status"]["rollout_from"] == "v1"


def test_one_service_in_full(fake: FakeGateway) -> None:
    history = [
        {
            "revision": r,
            "change": c,
            "reason": why,
            "version": v,
            "desired_replicas": 2,
            "ready_replicas": ready,
            "at": AT.isoformat(),
        }
        for r, c, why, v, ready in (
            (3, "rollout_started", "rolling out v2 in place of v1", "v2", 2),
            (2, "scaled", "to 2: load 31 rps needs 2 at 20 rps per replica", "v1", 1),
            (1, "declared", "llama-3-8b v1: 2 to 6 replica(s)", "v1", 0),
        )
    ]
    fake.add(rolling_chat(), history)
    result = run("services", "chat")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("GET", "/v1/services/chat", None)]
    out = result.output
    assert re.search(r"version\s+v2 \(previous v1\)", out)
    assert re.search(r"rollout\s+v1 → v2, started", out)
    assert re.search(r"replicas\s+3/2 ready/desired, 2\.\.6", out)
    starting = next(line for line in out.splitlines() if "svc-chat-3" in line)
    assert "starting" in starting and "no" in starting and "cloud-l4/cloud-l4-l4-0003" in starting
    guaranteed = next(line for line in out.splitlines() if "svc-chat-0" in line)
    assert "yes" in guaranteed and "10.0.0.0:8000" in guaranteed
    assert out.count("10.0.0.2:8000") == 2  # its replica row and its endpoint
    assert "10.0.0.3" not in out  # not ready: no address, no endpoint
    scaled = next(line for line in out.splitlines() if "scaled" in line)
    assert "load 31 rps needs 2" in scaled and "1/2" in scaled


def test_endpoints_alone_for_scripts(fake: FakeGateway) -> None:
    fake.add(rolling_chat())
    result = run("services", "chat", "--endpoints")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("GET", "/v1/services/chat/endpoints", None)]
    assert result.output.splitlines() == [
        "svc-chat-0\tv1\t10.0.0.0:8000",
        "svc-chat-1\tv1\t10.0.0.1:8000",
        "svc-chat-2\tv2\t10.0.0.2:8000",
    ]


def test_a_service_not_visible_is_a_404_message(fake: FakeGateway) -> None:
    fake.add(status("theirs", tenant="nlp"))
    result = run("services", "theirs")
    assert result.exit_code == 1
    assert "404 Not Found: no service theirs visible to this token" in result.output


# --- qm scale, qm unserve, qm rollout ------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "body", "command"),
    [
        (["--replicas", "3"], {"replicas": 3}, {"min_replicas": 3, "max_replicas": 3}),
        (["--min", "2", "--max", "8"], {"min_replicas": 2, "max_replicas": 8}, None),
        (["--max", "8"], {"max_replicas": 8}, {"min_replicas": None, "max_replicas": 8}),
    ],
)
def test_scale_sends_the_counts(
    fake: FakeGateway, options: list[str], body: dict[str, int], command: dict[str, Any] | None
) -> None:
    fake.add(status("chat"))
    result = run("scale", "chat", *options)
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("POST", "/v1/services/chat/scale", body)]
    assert fake.commands == [{"service": "chat", "action": "scale", **(command or body)}]
    assert "chat  scale sent" in result.output


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ([], "give --min and/or --max, or --replicas"),
        (["--replicas", "3", "--max", "4"], "not both"),
        (["--min", "5", "--max", "4"], "--min 5 is above --max 4"),
        (["--replicas", "0"], "'--replicas': 0 is not in the range x>=1"),
    ],
)
def test_scale_refuses_nonsense_before_asking(
    fake: FakeGateway, options: list[str], expected: str
) -> None:
    fake.add(status("chat"))
    result = run("scale", "chat", *options)
    assert result.exit_code == 2
    assert expected in " ".join(result.output.replace("│", " ").split())
    assert fake.requests == []


@pytest.mark.parametrize("action", ["pause", "resume", "undo"])
def test_rollout_actions_post_to_their_path(fake: FakeGateway, action: str) -> None:
    fake.add(rolling_chat())
    result = run("rollout", action, "chat")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("POST", f"/v1/services/chat/rollout/{action}", None)]
    assert fake.commands == [{"service": "chat", "action": action}]
    assert f"chat  {action} sent" in result.output
    assert "qm rollout status chat" in result.output


def test_rollout_undo_of_an_unknown_service_fails(fake: FakeGateway) -> None:
    result = run("rollout", "undo", "nope")
    assert result.exit_code == 1
    assert sent(fake) == [("POST", "/v1/services/nope/rollout/undo", None)]
    assert "no service nope visible" in result.output
    assert fake.commands == []


def test_rollout_status_counts_ready_replicas_per_version(fake: FakeGateway) -> None:
    fake.add(rolling_chat())
    result = run("rollout", "status", "chat")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("GET", "/v1/services/chat", None)]
    out = result.output
    assert re.search(r"phase\s+rolling", out)
    assert re.search(r"rollout\s+v1 → v2", out)
    assert re.search(r"ready\s+v2: 1 of 2 replica\(s\)\s*\n\s+v1: 2 of 2 replica\(s\)", out)
    assert re.search(r"reason\s+rolling out v2 in place of v1", out)


def test_rollout_status_when_steady(fake: FakeGateway) -> None:
    fake.add(status("chat", version="v2", previous_version="v1", replicas=[replica(0, "v2")]))
    result = run("rollout", "status", "chat")
    assert result.exit_code == 0, result.output
    assert "none under way; on v2 (previous v1" in result.output
    assert "v2: 1 of 1 replica(s)" in result.output


def test_per_version_lists_the_target_first_then_the_source_then_strays() -> None:
    s = status(
        "chat",
        version="v3",
        rollout_from="v2",
        phase="rolling",
        replicas=[replica(0, "v1"), replica(1, "v2"), replica(2, "v2", "failed")],
    )
    assert per_version(s) == [("v3", 0, 0), ("v2", 1, 2), ("v1", 1, 1)]


def test_unserve_deletes(fake: FakeGateway) -> None:
    fake.add(status("chat"))
    result = run("unserve", "chat")
    assert result.exit_code == 0, result.output
    assert sent(fake) == [("DELETE", "/v1/services/chat", None)]
    assert fake.commands == [{"service": "chat", "action": "delete"}]
    assert "chat  delete sent" in result.output


def test_names_are_quoted_into_the_path(fake: FakeGateway) -> None:
    result = run("unserve", "chat/rollout/undo")
    assert result.exit_code == 1
    assert fake.requests[0].url.raw_path == b"/v1/services/chat%2Frollout%2Fundo"


@pytest.mark.parametrize(
    "command", [["serve", "--help"], ["services", "--help"], ["rollout", "status", "--help"]]
)
def test_the_service_commands_keep_qm_quick(command: list[str], tmp_path: Path) -> None:
    assert among(loaded_after(command, tmp_path=tmp_path), HEAVY + REQUEST_ONLY) == []
