"""Where `qm` finds the gateway and token, and how it reads the gateway's answers."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from cli.client import (
    DEFAULT_GATEWAY,
    Connection,
    GatewayClient,
    Response,
    describe_error,
    parse_sse,
    resolve_connection,
)
from cli.errors import GatewayError
from tests.unit.cli.gateway_double import serving


def record(directory: Path, **fields: object) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "stack.json").write_text(json.dumps(fields))


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QM_STATE_DIR", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    ("option_url", "option_token", "expected"),
    [
        (None, None, Connection("http://127.0.0.1:9999", "dev-recorded")),
        ("http://gw:1/", None, Connection("http://gw:1", "dev-recorded")),
        (None, "dev-nlp", Connection("http://127.0.0.1:9999", "dev-nlp")),
    ],
)
def test_option_beats_stack_record(
    elsewhere: Path, option_url: str | None, option_token: str | None, expected: Connection
) -> None:
    record(elsewhere / ".qm", gateway_url="http://127.0.0.1:9999", token="dev-recorded")
    assert resolve_connection(option_url, option_token) == expected


def test_defaults_without_any_record(elsewhere: Path) -> None:
    assert resolve_connection(None, None) == Connection(DEFAULT_GATEWAY, None)


def test_record_is_found_from_a_subdirectory(
    elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record(elsewhere / ".qm", gateway_url="http://127.0.0.1:9999", token="t")
    (elsewhere / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(elsewhere / "a" / "b")
    assert resolve_connection(None, None).token == "t"


def test_state_dir_env_wins(elsewhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record(elsewhere / ".qm", token="here")
    record(elsewhere / "other", token="there")
    monkeypatch.setenv("QM_STATE_DIR", str(elsewhere / "other"))
    assert resolve_connection(None, None).token == "there"


def test_broken_record_falls_back_to_defaults(elsewhere: Path) -> None:
    (elsewhere / ".qm").mkdir()
    (elsewhere / ".qm" / "stack.json").write_text("{not json")
    assert resolve_connection(None, None) == Connection(DEFAULT_GATEWAY, None)


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (404, {"detail": "job j-1 not found"}, "404 Not Found: job j-1 not found"),
        (
            422,
            {
                "detail": [
                    {"loc": ["body", "resources", "accelerators"], "msg": "must be > 0"},
                    {"loc": ["body"], "msg": "bad"},
                ]
            },
            "422 Unprocessable Entity: resources.accelerators: must be > 0\nrequest: bad",
        ),
        (500, "boom", "500 Internal Server Error: boom"),
    ],
)
def test_error_detail_is_readable(status: int, body: object, expected: str) -> None:
    content = json.dumps(body).encode() if isinstance(body, dict) else str(body).encode()
    answer = httpx.Response(status, content=content)
    response = Response(status, answer.reason_phrase, content)
    assert describe_error(response) == expected


def test_sse_events_are_parsed_and_comments_skipped() -> None:
    lines = [
        ": keep-alive",
        'data: {"state": "queued"}',
        "",
        "event: x",
        'data: {"state":',
        'data: "running"}',
        "",
        'data: {"state": "succeeded"}',
    ]
    assert [e["state"] for e in parse_sse(lines)] == ["queued", "running", "succeeded"]


def test_client_sends_bearer_token_and_raises_with_hint() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"detail": "unknown token"})

    with (
        serving(handler) as double,
        GatewayClient(Connection(double.url, "dev-x")) as client,
        pytest.raises(GatewayError) as raised,
    ):
        client.job("j-1")
    assert double.requests[0].headers["Authorization"] == "Bearer dev-x"
    assert raised.value.status == 401
    assert "--token" in str(raised.value)


def test_query_body_and_path_prefix_reach_the_gateway() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(202, json={"job_id": "j-1"})

    with serving(handler) as double:
        with GatewayClient(Connection(f"{double.url}/qm/", None)) as client:
            client.jobs("queued", None, 5)
            assert client.submit({"name": "ünïcode"}) == {"job_id": "j-1"}
            client.cancel("j-1")
        listed, submitted, canceled = double.requests
    assert (listed.method, listed.url.path, dict(listed.url.params)) == (
        "GET",
        "/qm/v1/jobs",
        {"limit": "5", "state": "queued"},
    )
    assert submitted.headers["Content-Type"] == "application/json"
    assert json.loads(submitted.content) == {"name": "ünïcode"}
    assert (canceled.method, canceled.url.path) == ("DELETE", "/qm/v1/jobs/j-1")


def test_a_kept_connection_the_server_closed_is_opened_again() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"job_id": "j-1", "state": "queued"})

    with (
        serving(handler, hang_up=True) as double,
        GatewayClient(Connection(double.url, None)) as client,
    ):
        for _ in range(3):
            assert client.job("j-1")["state"] == "queued"
    assert len(double.requests) == 3


def test_a_kept_connection_closed_while_idle_is_not_used_for_a_submission() -> None:
    """uvicorn closes an idle kept-alive connection after 5 s: a POST after that must go out on
    a new connection, not fail (a POST is never sent twice, so it is checked before sending)."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"job_id": "j-1", "state": "queued"})

    with (
        serving(handler, hang_up=True) as double,
        GatewayClient(Connection(double.url, None)) as client,
    ):
        client.job("j-1")
        assert double.hung_up.acquire(timeout=10)  # the server has closed that connection
        assert client.submit({"name": "a"})["job_id"] == "j-1"
    assert [r.method for r in double.requests] == ["GET", "POST"]


def test_a_dropped_answer_to_a_submission_is_an_error_not_a_resend() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            raise RuntimeError("crash before answering")
        return httpx.Response(200, json={"job_id": "j-1", "state": "queued"})

    with (
        serving(handler) as double,
        GatewayClient(Connection(double.url, None)) as client,
    ):
        client.job("j-1")  # the POST below goes out on this kept connection
        with pytest.raises(GatewayError, match="cannot reach the gateway"):
            client.submit({"name": "a"})
    assert [r.method for r in double.requests] == ["GET", "POST"]


def test_ids_are_one_path_segment_whatever_they_hold() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"job_id": "x"})

    with serving(handler) as double, GatewayClient(Connection(double.url, None)) as client:
        client.job("jöb a/b")
        client.cancel("j?1#2")
        client.node("n%1")
    assert [r.url.raw_path for r in double.requests] == [
        b"/v1/jobs/j%C3%B6b%20a%2Fb",
        b"/v1/jobs/j%3F1%232",
        b"/v1/nodes/n%251",
    ]


def test_an_answer_that_is_not_json_is_a_clear_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>a proxy's login page</html>")

    with (
        serving(handler) as double,
        GatewayClient(Connection(double.url, None)) as client,
        pytest.raises(GatewayError, match="not JSON"),
    ):
        client.job("j-1")


def test_a_header_that_cannot_be_sent_is_a_clear_error() -> None:
    with (
        GatewayClient(Connection("http://127.0.0.1:1", "bad\ntoken")) as client,
        pytest.raises(GatewayError, match="cannot send that request"),
    ):
        client.job("j-1")


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("http://[::1]", "::1", 80),
        ("https://[::1]:8443/qm", "::1", 8443),
        ("https://gw.example", "gw.example", 443),
        ("http://gw.example:8080", "gw.example", 8080),
    ],
)
def test_default_ports_and_ipv6_hosts(url: str, host: str, port: int) -> None:
    client = GatewayClient(Connection(url, None))
    assert (client._host, client._port) == (host, port)


def sse(*events: object, cut: bool = False) -> httpx.Response:
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    headers = {"content-type": "text/event-stream", "transfer-encoding": "chunked"}
    if cut:
        headers["x-double-cut"] = "yes"
    return httpx.Response(200, content=body.encode(), headers=headers)


def test_a_streamed_event_feed_is_read_event_by_event() -> None:
    with (
        serving(lambda r: sse({"state": "queued"}, {"state": "running"})) as double,
        GatewayClient(Connection(double.url, None)) as client,
    ):
        assert [e["state"] for e in client.events("j-1")] == ["queued", "running"]


def test_a_streamed_event_feed_cut_off_is_an_error_not_an_end() -> None:
    """A chunked stream closed without its last (empty) chunk broke off; reading it line by
    line would have ended quietly, as if the server had ended it."""
    seen: list[str] = []
    with (
        serving(lambda r: sse({"state": "queued"}, cut=True)) as double,
        GatewayClient(Connection(double.url, None)) as client,
        pytest.raises(GatewayError, match="broke off"),
    ):
        for event in client.events("j-1"):
            seen.append(event["state"])
    assert seen == ["queued"]


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "http://127.0.0.1:99999", "ftp://gw", "gw"])
def test_unreachable_or_malformed_gateway_says_so(url: str) -> None:
    with (
        pytest.raises(GatewayError, match=r"is the stack up|is not a gateway URL"),
        GatewayClient(Connection(url, None)) as client,
    ):
        client.jobs(None, None, 10)


def test_event_stream_errors_are_readable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "job j-9 not found"})

    with (
        serving(handler) as double,
        GatewayClient(Connection(double.url, None)) as client,
        pytest.raises(GatewayError, match="404 Not Found: job j-9 not found"),
    ):
        list(client.events("j-9"))


@pytest.mark.parametrize("url", ["https://gw.example", "HTTPS://gw.example:8443"])
def test_an_https_gateway_is_verified(url: str) -> None:
    """Only a plain-http gateway skips loading the CA store (a faster start); an https one
    keeps certificate and host checks."""
    import ssl

    with GatewayClient(Connection(url, None)) as client:
        context = client._context
        assert context is not None
        assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    with GatewayClient(Connection("http://gw.example", None)) as client:
        assert client._context is None
