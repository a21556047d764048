"""Talking to the gateway: where it is, which token to send, and its errors as plain messages."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.errors import GatewayError

# httpx (with ssl, http.client, email, urllib.request) is a good part of `qm`'s start-up time:
# it is imported where a request is made, so `qm --help`, `qm logs` and the like never load it.
if TYPE_CHECKING:
    import httpx

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
    """Option (or its env var, which typer folds in) first, then stack.json, then defaults."""
    recorded = _recorded()
    url = gateway or recorded.get("gateway_url") or DEFAULT_GATEWAY
    return Connection(url.rstrip("/"), token or recorded.get("token"))


def describe_error(response: httpx.Response) -> str:
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


class GatewayClient:
    """The gateway's job API, one method per endpoint, errors raised as GatewayError."""

    def __init__(
        self,
        connection: Connection,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,  # tests pass an httpx.MockTransport
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {connection.token}"} if connection.token else {}
        self.base = connection.gateway
        # Loading the CA bundle for certificate checks is about 50 ms of a command's start;
        # a plain-http gateway (the dev stack's) never uses it. An https one is verified.
        verify = not self.base.lower().startswith("http://")
        self._http = httpx.Client(
            base_url=self.base,
            headers=headers,
            timeout=timeout,
            transport=transport,
            verify=verify,
        )

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise GatewayError(
                f"cannot reach the gateway at {self.base} ({exc}); is the stack up? (qm up)"
            ) from exc
        self._raise_for(response)
        return response.json() if response.content else {}

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.is_success:
            return
        message = describe_error(response)
        if hint := _HINTS.get(response.status_code):
            message += f"\n  hint: {hint}"
        raise GatewayError(message, status=response.status_code)

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call("POST", "/v1/jobs", json=body))

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/jobs/{job_id}"))

    def jobs(self, state: str | None, queue: str | None, limit: int) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"limit": limit}
        params.update({k: v for k, v in (("state", state), ("queue", queue)) if v})
        return list(self._call("GET", "/v1/jobs", params=params).get("jobs", []))

    def cancel(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("DELETE", f"/v1/jobs/{job_id}"))

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
        from urllib.parse import quote

        return dict(self._call("GET", f"/v1/nodes/{quote(node_id, safe='')}"))

    def queues(self, hours: float | None = None) -> dict[str, Any]:
        params = {"hours": hours} if hours is not None else {}
        return dict(self._call("GET", "/v1/queues", params=params))

    def explain(self, job_id: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/v1/jobs/{job_id}/explain"))

    def events(self, job_id: str) -> Iterator[dict[str, Any]]:
        """Follow a job's lifecycle events as they happen (no read timeout: they may be rare)."""
        import httpx

        timeout = httpx.Timeout(10.0, read=None)
        path = f"/v1/jobs/{job_id}/events"
        try:
            with self._http.stream("GET", path, params={"follow": "true"}, timeout=timeout) as r:
                if not r.is_success:
                    r.read()
                    self._raise_for(r)
                yield from parse_sse(r.iter_lines())
        except httpx.HTTPError as exc:
            raise GatewayError(f"event stream from {self.base} broke off ({exc})") from exc
