"""Talking to the gateway: where it is, which token to send, and its errors as plain messages."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode, urlsplit

from cli.errors import GatewayError

# The standard library's http.client is the gateway's client: httpx (with httpcore, its
# auth and its pools) took about 60 ms of every command's start, more than the request.
if TYPE_CHECKING:
    import http.client
    import ssl

DEFAULT_GATEWAY = "http://127.0.0.1:8080"
STATE_DIR_NAME = ".qm"
TERMINAL_STATES = frozenset({"succeeded", "failed", "canceled", "rejected"})


def state_dir() -> Path:
    """Where `qm up` keeps stack.json and logs: ``$QM_STATE_DIR``, else ``./.qm``."""
    return Path(os.environ.get("QM_STATE_DIR") or STATE_DIR_NAME)


def find_state_file() -> Path | None:
    """The nearest recorded stack.json: ``$QM_STATE_DIR``, else ``.qm`` here or in a parent."""
    if explicit := os.environ.get("QM_STATE_DIR"):
        path = Path(explicit) / "stack.json"
        return path if path.exists() else None
    here = Path.cwd()
    for directory in (here, *here.parents):
        path = directory / STATE_DIR_NAME / "stack.json"
        if path.exists():
            return path
    return None


def _recorded() -> dict[str, Any]:
    path = find_state_file()
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a broken record must not stop `qm status` from using its defaults
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Connection:
    gateway: str
    token: str | None


def resolve_connection(gateway: str | None, token: str | None) -> Connection:
    """Option (or its env var, which click folds in) first, then stack.json, then defaults."""
    recorded = _recorded()
    url = gateway or recorded.get("gateway_url") or DEFAULT_GATEWAY
    return Connection(url.rstrip("/"), token or recorded.get("token"))


def describe_error(response: Response) -> str:
    """The server's ``detail`` in readable form: a string, or one line per validation error."""
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        detail = response.text
    if isinstance(detail, list):
        lines = []
        for item in detail:
            if isinstance(item, dict):
                loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
                lines.append(f"{loc or 'request'}: {item.get('msg', item)}")
            else:
                lines.append(str(item))
        detail = "\n".join(lines)
    elif not isinstance(detail, str):
        detail = json.dumps(detail)
    return f"{response.status_code} {response.reason_phrase}: {detail}".rstrip(": ")


_HINTS = {
    401: "pass --token or set QM_TOKEN (the tokens are in examples/auth.yaml)",
    403: "this token's tenant or role may not do that",
}


def parse_sse(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Events of a server-sent-events stream: ``data:`` lines joined, one event per blank line."""
    data: list[str] = []
    for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line.strip() and data:
            yield json.loads("\n".join(data))
            data = []
        # other fields (event:, id:, retry:) and ":" keep-alive comments carry nothing for us
    if data:
        yield json.loads("\n".join(data))


@dataclass(frozen=True)
class Response:
    """A whole answer of the gateway (what the commands read of it)."""

    status_code: int
    reason_phrase: str
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


@dataclass(frozen=True)
class Proxy:
    """An HTTP proxy to reach the gateway through, and the Proxy-Authorization to send it."""

    host: str
    port: int
    authorization: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Proxy-Authorization": self.authorization} if self.authorization else {}


def _loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.") or host.lower().endswith(".localhost"):
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether NO_PROXY names `host` (curl's rules: `*` for every host, else comma-separated
    names or addresses, each matching itself and, as a domain, its subdomains, a leading dot
    or not; an entry with `:port` only on that port)."""
    host = host.lower().rstrip(".")
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        if entry.startswith("[") and "]:" in entry:  # [v6 address]:port
            name, _, only = entry[1:].partition("]:")
        elif entry.count(":") == 1:  # name:port (more colons: a bare v6 address)
            name, _, only = entry.partition(":")
        else:
            name, only = entry, ""
        if only and (not only.isdigit() or int(only) != port):
            continue
        name = name.strip("[]").lstrip(".").rstrip(".")
        if name and (host == name or host.endswith("." + name)):
            return True
    return False


def proxy_for(
    scheme: str, host: str, port: int, environ: dict[str, str] | None = None
) -> Proxy | None:
    """The proxy for a gateway at scheme://host:port, from the environment as curl reads it:
    `https_proxy`/`HTTPS_PROXY` for an https gateway, `http_proxy`/`HTTP_PROXY` for a plain
    one (the lower-case name first), unless `no_proxy`/`NO_PROXY` names the host. A loopback
    gateway (the dev stack's) is always reached directly. Only http:// proxies are spoken to;
    user and password in the proxy's URL go as Basic Proxy-Authorization."""
    env = os.environ if environ is None else environ
    raw = (env.get(f"{scheme}_proxy") or env.get(f"{scheme.upper()}_PROXY") or "").strip()
    if not raw or _loopback(host):
        return None
    no_proxy = env.get("no_proxy") or env.get("NO_PROXY") or ""
    if _bypassed(host, port, no_proxy):
        return None
    url = urlsplit(raw if "://" in raw else f"http://{raw}")
    shown = url._replace(netloc=url.netloc.rpartition("@")[2]).geturl()  # no credentials
    if url.scheme.lower() != "http" or not url.hostname:
        raise GatewayError(
            f"the proxy {shown!r} ({scheme}_proxy) is not an http:// proxy URL: qm speaks to "
            "a proxy over plain HTTP (an https gateway is still end-to-end TLS through it)"
        )
    try:
        proxy_port = url.port or 80
    except ValueError as exc:
        raise GatewayError(f"the proxy {shown!r} ({scheme}_proxy) has a bad port: {exc}") from exc
    authorization = None
    if url.username is not None:
        import base64
        from urllib.parse import unquote

        pair = f"{unquote(url.username)}:{unquote(url.password or '')}".encode()
        authorization = "Basic " + base64.b64encode(pair).decode("ascii")
    return Proxy(url.hostname, proxy_port, authorization)


# A connection kept open across requests may have been closed by the server in between; only
# a request that changes nothing is sent again on a new one.
_IDEMPOTENT = frozenset({"GET", "HEAD", "DELETE"})


class GatewayClient:
    """The gateway's job API, one method per endpoint, errors raised as GatewayError."""

    def __init__(self, connection: Connection, timeout: float = 10.0) -> None:
        self.base = connection.gateway
        url = urlsplit(self.base)
        scheme = url.scheme.lower()
        if scheme not in ("http", "https") or not url.hostname:
            raise GatewayError(f"{self.base!r} is not a gateway URL (http://host:port)")
        self._https = scheme == "https"
        self._host = url.hostname
        try:
            # Always explicit: http.client would read "::1" (an IPv6 host) as host and port.
            self._port = url.port or (443 if self._https else 80)
        except ValueError as exc:
            raise GatewayError(f"{self.base!r} is not a gateway URL ({exc})") from exc
        self._prefix = url.path.rstrip("/")  # a gateway served under a path
        self._timeout = timeout
        self._headers = {"Accept": "application/json", "User-Agent": "qm"}
        if connection.token:
            self._headers["Authorization"] = f"Bearer {connection.token}"
        # Certificates are checked against the system's CA store (SSL_CERT_FILE and
        # SSL_CERT_DIR override it); a plain-http gateway, the dev stack's, never loads it.
        # Through a proxy (proxy_for), an https gateway is reached in a CONNECT tunnel, with
        # TLS to the gateway itself; a plain one by asking the proxy for its absolute URL.
        self._proxy = proxy_for(scheme, self._host, self._port)
        self._origin = ""
        if self._proxy is not None and not self._https:
            shown = f"[{self._host}]" if ":" in self._host else self._host
            self._origin = f"http://{shown}:{self._port}"
            self._headers.update(self._proxy.headers())
        self._context: ssl.SSLContext | None = None
        if self._https:
            import ssl

            self._context = ssl.create_default_context()
        self._open: http.client.HTTPConnection | None = None

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def _connect(self, timeout: float | None) -> http.client.HTTPConnection:
        import http.client

        proxy = self._proxy
        host, port = (self._host, self._port) if proxy is None else (proxy.host, proxy.port)
        if self._context is not None:
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=self._context
            )
            if proxy is not None:  # TLS with the gateway inside the proxy's tunnel
                connection.set_tunnel(self._host, self._port, headers=proxy.headers())
            return connection
        return http.client.HTTPConnection(host, port, timeout=timeout)

    def _target(self, path: str, params: dict[str, Any] | None) -> str:
        query = {k: v for k, v in (params or {}).items() if v is not None}
        return self._origin + self._prefix + path + (f"?{urlencode(query)}" if query else "")

    def _send(
        self,
        connection: http.client.HTTPConnection,
        method: str,
        target: str,
        body: bytes | None,
        headers: dict[str, str],
    ) -> http.client.HTTPResponse:
        connection.request(method, target, body=body, headers=headers)
        return connection.getresponse()

    def _request(
        self, method: str, path: str, params: dict[str, Any] | None, payload: Any
    ) -> Response:
        import http.client

        headers = dict(self._headers)
        body = None
        if payload is not None:
            body = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        target = self._target(path, params)
        if self._open is not None and _dropped(self._open):
            self.close()  # closed by the server while idle (uvicorn: after 5 s): not reused
        reused = self._open is not None
        try:
            if self._open is None:
                self._open = self._connect(self._timeout)
            try:
                answer = self._send(self._open, method, target, body, headers)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                if not reused or method not in _IDEMPOTENT:
                    raise
                self.close()  # the server closed the kept connection; once more on a new one
                self._open = self._connect(self._timeout)
                answer = self._send(self._open, method, target, body, headers)
            content = answer.read()
            if answer.will_close:
                self.close()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.close()
            raise self._unsent(exc) from exc
        return Response(answer.status, answer.reason, content)

    def _unsent(self, exc: Exception) -> GatewayError:
        """The error for a request that got no answer: the gateway unreachable, or (a
        ValueError) a header or target http.client refuses to send."""
        if isinstance(exc, ValueError):
            return GatewayError(f"cannot send that request to {self.base}: {exc}")
        if self._proxy is not None:
            return GatewayError(
                f"cannot reach the gateway at {self.base} through the proxy "
                f"{self._proxy.host}:{self._proxy.port} ({_reason(exc)}); check the proxy, "
                "or name the gateway's host in NO_PROXY to reach it directly"
            )
        return GatewayError(
            f"cannot reach the gateway at {self.base} ({_reason(exc)}); is the stack up? (qm up)"
        )

    def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        json: Any = None,
    ) -> Any:
        response = self._request(method, path, params, json)
        self._raise_for(response)
        if not response.content:
            return {}
        try:
            return response.json()
        except ValueError as exc:
            raise GatewayError(
                f"the gateway at {self.base} answered {method} {path} with something that is "
                f"not JSON ({exc}); is that URL a Quartermaster gateway?"
            ) from exc

    @staticmethod
    def _raise_for(response: Response) -> None:
        if response.is_success:
            return
        message = describe_error(response)
        if hint := _HINTS.get(response.status_code):
            message += f"\n  hint: {hint}"
        raise GatewayError(message, status=response.status_code)

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call("POST", "/v1/jobs", json=body))

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/jobs/{_segment(job_id)}"))

    def jobs(self, state: str | None, queue: str | None, limit: int) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        params.update({k: v for k, v in (("state", state), ("queue", queue)) if v})
        return list(self._call("GET", "/v1/jobs", params=params).get("jobs", []))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/jobs/{_segment(job_id)}"))

    def pools(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/pools"))

    def fleet(self, *, cells: bool = True) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/fleet", params={"cells": str(cells).lower()}))

    def nodes(
        self,
        cluster: str | None = None,
        accelerator_type: str | None = None,
        state: str | None = None,
    ) -> list[dict[str, Any]]:
        filters = (("cluster", cluster), ("type", accelerator_type), ("state", state))
        params = {k: v for k, v in filters if v}
        return list(self._call("GET", "/v1/nodes", params=params).get("nodes", []))

    def node(self, node_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/nodes/{_segment(node_id)}"))

    def queues(self, hours: float | None = None) -> dict[str, Any]:
        params = {"hours": hours} if hours is not None else {}
        return dict(self._call("GET", "/v1/queues", params=params))

    def explain(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/jobs/{_segment(job_id)}/explain"))

    def events(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Follow a job's lifecycle events as they happen (no read timeout: they may be rare)."""
        import http.client

        target = self._target(f"/v1/jobs/{_segment(job_id)}/events", {"follow": "true"})
        headers = {**self._headers, "Accept": "text/event-stream"}
        stream = self._connect(self._timeout)
        try:
            try:
                stream.request("GET", target, headers=headers)
                if stream.sock is not None:
                    stream.sock.settimeout(None)
                answer = stream.getresponse()
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise self._unsent(exc) from exc
            if not 200 <= answer.status < 300:
                self._raise_for(Response(answer.status, answer.reason, answer.read()))
            try:
                yield from parse_sse(_lines(answer))
            except (OSError, http.client.HTTPException) as exc:
                raise GatewayError(
                    f"event stream from {self.base} broke off ({_reason(exc)})"
                ) from exc
            except ValueError as exc:  # an event that is not JSON
                raise GatewayError(f"unreadable event from {self.base}: {exc}") from exc
        finally:
            stream.close()


def _lines(answer: http.client.HTTPResponse) -> Iterator[str]:
    """The stream's lines as they arrive. Read with `read1`, which raises IncompleteRead when a
    chunked stream is cut off (`readline` would end it quietly, as if the server had)."""
    pending = b""
    while chunk := answer.read1(65536):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace").rstrip("\r")
    if pending:
        yield pending.decode("utf-8", "replace").rstrip("\r")


def _dropped(connection: http.client.HTTPConnection) -> bool:
    """Whether a kept connection can no longer carry a request: no socket, or one that is
    readable while no answer is due (the server closed it, or sent something unasked)."""
    import select

    sock = connection.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _segment(value: str) -> str:
    """One path segment: a job id with '/', spaces or non-ASCII letters stays one segment."""
    return quote(value, safe="")


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
