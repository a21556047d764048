"""Job files become request bodies; job commands print what the gateway says."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from cli.errors import QmError
from cli.jobs import job_body, load_job_file
from cli.main import app
from schemas.job import JobSpec
from tests.unit.cli.gateway_double import GatewayDouble, Handler

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "jobs"


def test_labels_become_strings_and_dates_iso() -> None:
    import datetime as dt

    body = job_body(
        {"labels": {"sim_duration_s": 600, "spot": True, "day": dt.date(2024, 5, 1)}, "replicas": 2}
    )
    assert body == {
        "labels": {"sim_duration_s": "600", "spot": "true", "day": "2024-05-01"},
        "replicas": 2,
    }
    json.dumps(body)  # must be sendable as is


def test_several_documents_are_several_jobs(tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text("name: a\n---\nname: b\n")
    assert [b["name"] for b in load_job_file(path)] == ["a", "b"]


@pytest.mark.parametrize("text", ["", "- a\n- b\n", "name: [unclosed\n"])
def test_not_a_job_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(QmError):
        load_job_file(path)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_jobs_are_valid_specs(path: Path) -> None:
    for body in load_job_file(path):
        spec = JobSpec.model_validate({"tenant": "vision", **body})
        assert spec.labels.get("sim_duration_s")


@pytest.fixture
def gateway(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[Handler], list[httpx.Request]]]:
    """Point the job commands at a gateway double answering with ``handler``; returns the
    requests it saw."""
    doubles: list[GatewayDouble] = []

    def install(handler: Handler) -> list[httpx.Request]:
        double = GatewayDouble(handler)
        double.start()
        doubles.append(double)
        monkeypatch.setenv("QM_GATEWAY_URL", double.url)
        monkeypatch.setenv("QM_STATE_DIR", "/nonexistent")
        return double.requests

    yield install
    for double in doubles:
        double.stop()


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_submit_posts_the_yaml_and_prints_the_id(gateway: Any) -> None:
    seen = gateway(lambda r: httpx.Response(202, json={"job_id": "j-42", "state": "submitted"}))
    result = run("submit", "-f", str(EXAMPLES / "train-8xh100.yaml"), "--token", "dev-vision")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "j-42"
    body = json.loads(seen[0].content)
    assert (seen[0].method, seen[0].url.path) == ("POST", "/v1/jobs")
    assert body["tenant"] == "vision" and body["resources"]["accelerator_types"] == ["H100"]
    assert seen[0].headers["Authorization"] == "Bearer dev-vision"


def test_submit_shows_validation_errors_and_fails(gateway: Any) -> None:
    detail = [{"loc": ["body", "replicas"], "msg": "Input should be greater than 0"}]
    gateway(lambda r: httpx.Response(422, json={"detail": detail}))
    result = run("submit", "-f", str(EXAMPLES / "eval-1xa100.yaml"))
    assert result.exit_code == 1
    assert "replicas: Input should be greater than 0" in result.output


def test_submit_wait_reports_rejection(gateway: Any) -> None:
    answers = iter(
        [
            httpx.Response(202, json={"job_id": "j-1", "state": "submitted"}),
            httpx.Response(404, json={"detail": "not yet"}),
            httpx.Response(200, json={"job_id": "j-1", "state": "submitted"}),
            httpx.Response(
                200,
                json={
                    "job_id": "j-1",
                    "state": "rejected",
                    "reason_code": "unknown_queue",
                    "message": "no queue 'x'",
                },
            ),
        ]
    )
    gateway(lambda r: next(answers))
    result = run("submit", "-f", str(EXAMPLES / "eval-1xa100.yaml"), "--wait")
    assert result.exit_code == 1
    assert "rejected" in result.output and "unknown_queue" in result.output


def test_status_prints_summary_and_history(gateway: Any) -> None:
    job = {
        "job_id": "j-1",
        "tenant": "vision",
        "project": "p",
        "user": "u",
        "queue": "default",
        "name": "n",
        "state": "running",
        "reason_code": None,
        "message": None,
        "cluster": "onprem-h100",
        "nodes": ["onprem-h100-h100-0"],
        "submitted_at": "2024-05-01T10:00:00Z",
        "updated_at": "2024-05-01T10:00:01Z",
        "spec": {"replicas": 1, "resources": {"accelerators": 8, "accelerator_types": ["H100"]}},
        "history": [
            {
                "at": "2024-05-01T10:00:00Z",
                "state": "queued",
                "event_type": "JobQueued",
                "reason_code": None,
                "message": None,
            }
        ],
    }
    gateway(lambda r: httpx.Response(200, json=job))
    result = run("status", "j-1")
    assert result.exit_code == 0, result.output
    for text in ("running", "onprem-h100-h100-0", "1 x 8 H100", "JobQueued"):
        assert text in result.output


def test_list_passes_filters(gateway: Any) -> None:
    seen = gateway(
        lambda r: httpx.Response(
            200,
            json={
                "jobs": [{"job_id": "j-1", "state": "queued", "replicas": 1, "accelerators": 8.0}]
            },
        )
    )
    result = run("list", "--state", "queued", "--queue", "batch", "--limit", "5")
    assert result.exit_code == 0, result.output
    assert dict(seen[0].url.params) == {"state": "queued", "queue": "batch", "limit": "5"}
    assert "j-1" in result.output


def test_cancel(gateway: Any) -> None:
    seen = gateway(
        lambda r: httpx.Response(202, json={"job_id": "j-1", "state": "cancel_requested"})
    )
    result = run("cancel", "j-1")
    assert result.exit_code == 0 and "cancel_requested" in result.output
    assert seen[0].method == "DELETE"


def test_watch_stops_at_a_terminal_state(gateway: Any) -> None:
    events = [
        {"at": "2024-05-01T10:00:00Z", "state": s, "event_type": e, "type": e}
        for s, e in (
            ("queued", "JobQueued"),
            ("running", "JobStarted"),
            ("succeeded", "JobFinished"),
            ("queued", "never-read"),
        )
    ]
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    seen = gateway(
        lambda r: httpx.Response(200, text=stream, headers={"content-type": "text/event-stream"})
    )
    result = run("watch", "j-1")
    assert result.exit_code == 0, result.output
    assert "JobFinished" in result.output and "never-read" not in result.output
    assert seen[0].url.params["follow"] == "true"


def test_explain(gateway: Any) -> None:
    gateway(
        lambda r: httpx.Response(
            200,
            json={"job_id": "j-1", "state": "queued", "codes": ["no_capacity"], "message": "full"},
        )
    )
    result = run("explain", "j-1")
    assert result.exit_code == 0 and "no_capacity" in result.output and "full" in result.output
