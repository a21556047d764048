"""`qm` behind an HTTP proxy: which proxy the environment names for a gateway (curl's rules),
and what goes over the wire to a real proxy on a socket: an absolute URL for a plain-http
gateway, a CONNECT tunnel for an https one, Basic credentials from the proxy's URL."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli.client import Connection, GatewayClient, Proxy, proxy_for
from cli.errors import GatewayError

PROXY_ENV = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "no_proxy", "NO_PROXY")


@pytest.fixture(autouse=True)
def no_proxy_from_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("env", "scheme", "host", "port", "expected"),
    [
        ({}, "https", "gw.example", 443, None),
        ({"HTTPS_PROXY": "http://px:3128"}, "https", "gw.example", 443, Proxy("px", 3128)),
        ({"HTTPS_PROXY": "px:3128"}, "https", "gw.example", 443, Proxy("px", 3128)),
        ({"HTTPS_PROXY": "http://px"}, "https", "gw.example", 443, Proxy("px", 80)),
        ({"https_proxy": "http://low:1", "HTTPS_PROXY": "http://up:2"}, "https", "g", 443,
         Proxy("low", 1)),
        ({"HTTP_PROXY": "http://px:3128"}, "https", "gw.example", 443, None),
        ({"HTTPS_PROXY": "http://px:3128"}, "http", "gw.example", 80, None),
        ({"HTTP_PROXY": "http://px:3128"}, "http", "gw.example", 80, Proxy("px", 3128)),
        ({"HTTPS_PROXY": "http://px:1"}, "https", "127.0.0.1", 443, None),
        ({"HTTPS_PROXY": "http://px:1"}, "https", "::1", 443, None),
        ({"HTTPS_PROXY": "http://px:1"}, "https", "localhost", 443, None),
        ({"HTTPS_PROXY": "http://px:1", "NO_PROXY": "*"}, "https", "gw.example", 443, None),
        ({"HTTPS_PROXY": "http://px:1", "NO_PROXY": "example"}, "https", "gw.example", 443,
         None),
        ({"HTTPS_PROXY": "http://px:1", "no_proxy": ".example"}, "https", "gw.example", 443,
         None),
        ({"HTTPS_PROXY": "http://px:1", "NO_PROXY": "ample"}, "https", "gw.example", 443,
         Proxy("px", 1)),
        ({"HTTPS_PROXY": "http://px:1", "NO_PROXY": "a.b, gw.example:8443"}, "https",
         "gw.example", 8443, None),
        ({"HTTPS_PROXY": "http://px:1", "NO_PROXY": "gw.example:8443"}, "https", "gw.example",
         443, Proxy("px", 1)),
        ({"HTTPS_PROXY": "http://px:1", "NO_PROXY": "[2001:db8::5]:443"}, "https",
         "2001:db8::5", 443, None),
        ({"HTTPS_PROXY": "http://px:1", "NO_PROXY": "2001:db8::5"}, "https", "2001:db8::5",
         443, None),
        ({"HTTPS_PROXY": "http://me:s%3Acret@px:1"}, "https", "g", 443,
         Proxy("px", 1, "Basic bWU6czpjcmV0")),
    ],
)  # fmt: skip
def test_the_proxy_is_the_one_curl_would_use(
    env: dict[str, str], scheme: str, host: str, port: int, expected: Proxy | None
) -> None:
    assert proxy_for(scheme, host, port, env) == expected


@pytest.mark.parametrize(
    "raw",
    [
        "https://px:3128",
        "socks5://px:1080",
        "http://px:99999",
        "https://me:s3cret@px:3128",
        "http://me:s3cret@px:99999",
    ],
)
def test_a_proxy_qm_cannot_speak_to_is_a_clear_error(raw: str) -> None:
    with pytest.raises(GatewayError, match="proxy") as raised:
        proxy_for("https", "gw.example", 443, {"HTTPS_PROXY": raw})
    assert "s3cret" not in str(raised.value) and "me:" not in str(raised.value)


class ProxyDouble:
    """A real proxy on 127.0.0.1 that records each request line and its headers. It answers
    a plain request for the absolute URL itself (as the gateway behind it would) and accepts
    a CONNECT, then hangs up (no TLS gateway behind it: the client's handshake fails)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        double = self

        class Handle(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                double.seen.append((self.command, self.path, dict(self.headers.items())))
                body = b'{"queues": []}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_CONNECT(self) -> None:
                double.seen.append((self.command, self.path, dict(self.headers.items())))
                self.send_response(200, "Connection established")
                self.end_headers()
                self.close_connection = True

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handle)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)


@contextmanager
def proxying() -> Iterator[ProxyDouble]:
    double = ProxyDouble()
    double._thread.start()
    try:
        yield double
    finally:
        double._server.shutdown()
        double._server.server_close()


def test_a_plain_gateway_is_asked_for_by_its_absolute_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with proxying() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url.replace("http://", "http://qm:pw@"))
        with GatewayClient(Connection("http://gw.test:8080/qm", "tok")) as client:
            assert client.queues() == {"queues": []}
    [(method, target, headers)] = proxy.seen
    assert (method, target) == ("GET", "http://gw.test:8080/qm/v1/queues")
    assert headers["Proxy-Authorization"] == "Basic cW06cHc="
    assert headers["Authorization"] == "Bearer tok"


def test_an_https_gateway_is_reached_through_a_tunnel(monkeypatch: pytest.MonkeyPatch) -> None:
    with proxying() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url.replace("http://", "http://qm:pw@"))
        with (
            GatewayClient(Connection("https://gw.test", "tok")) as client,
            pytest.raises(GatewayError, match=r"through the proxy 127\.0\.0\.1"),
        ):
            client.queues()
    [(method, target, headers)] = proxy.seen
    assert (method, target) == ("CONNECT", "gw.test:443")
    assert headers["Proxy-Authorization"] == "Basic cW06cHc="
    # The gateway's token travels only inside the tunnel, never to the proxy.
    assert "Authorization" not in headers


def test_an_unreachable_proxy_says_so_and_how_to_go_around_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    with (
        GatewayClient(Connection("http://gw.test:8080", None)) as client,
        pytest.raises(GatewayError, match="NO_PROXY"),
    ):
        client.queues()


def test_the_dev_stack_is_never_reached_through_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    client = GatewayClient(Connection("http://127.0.0.1:8080", None))
    assert client._proxy is None and client._target("/v1/jobs", None) == "/v1/jobs"
