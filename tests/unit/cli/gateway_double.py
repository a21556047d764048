"""A gateway double for the CLI's tests: a real HTTP server on 127.0.0.1 that hands every
request to a test's handler (``httpx.Request -> httpx.Response``) and writes its answer back,
so that `qm` is tested through its own HTTP client and a real socket.

A handler that raises drops the connection without an answer, as a crashing server would. An
answer with ``Transfer-Encoding: chunked`` is sent in chunks of one line each (as a server
streams events); with ``X-Double-Cut: yes`` as well, the connection is closed after the last
chunk without the terminating empty chunk (a stream broken off).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

Handler = Callable[[httpx.Request], httpx.Response]


class _Server(ThreadingHTTPServer):
    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        closed: threading.Semaphore,
    ) -> None:
        super().__init__(address, handler)
        self.closed = closed

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)  # the socket is closed once this returns
        self.closed.release()


class GatewayDouble:
    """``hang_up``: close each connection after its answer without saying so (no
    ``Connection: close``), as a server does to a kept-alive connection at its idle timeout."""

    def __init__(self, handler: Handler, *, hang_up: bool = False) -> None:
        self.handler = handler
        self.hang_up = hang_up
        self.hung_up = threading.Semaphore(0)  # released each time a connection is closed
        self.requests: list[httpx.Request] = []
        self._server = _Server(("127.0.0.1", 0), self._request_handler(), self.hung_up)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _request_handler(self) -> type[BaseHTTPRequestHandler]:
        double = self

        class Handle(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the real gateway (uvicorn)

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                request = httpx.Request(
                    self.command,
                    double.url + self.path,
                    headers=list(self.headers.items()),
                    content=body,
                )
                double.requests.append(request)
                try:
                    response = double.handler(request)
                except Exception:
                    self.close_connection = True  # no answer at all
                    return
                content = response.read()
                chunked = response.headers.get("transfer-encoding") == "chunked"
                self.send_response(response.status_code, HTTPStatus(response.status_code).phrase)
                for name, value in response.headers.items():
                    if name.lower() not in ("content-length", "transfer-encoding", "x-double-cut"):
                        self.send_header(name, value)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                if not chunked:
                    self.wfile.write(content)
                else:
                    for line in content.splitlines(keepends=True):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    if response.headers.get("x-double-cut") == "yes":
                        self.close_connection = True
                        return
                    self.wfile.write(b"0\r\n\r\n")
                if double.hang_up:
                    self.close_connection = True

            do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass  # quiet tests

        return Handle

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def serving(handler: Handler, *, hang_up: bool = False) -> Iterator[GatewayDouble]:
    double = GatewayDouble(handler, hang_up=hang_up)
    double.start()
    try:
        yield double
    finally:
        double.stop()
