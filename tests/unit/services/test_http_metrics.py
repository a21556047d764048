"""Every service's HTTP latency histogram: labelled by route template (never the path, which
carries ids) and status class, observed once per request, including requests that fail."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from services.common.runtime import Runtime, create_http_app, status_class
from services.common.settings import ServiceSettings

METRIC = "qm_http_request_duration_seconds_count"


def app_with_routes() -> tuple[FastAPI, CollectorRegistry]:
    runtime = Runtime("test", ServiceSettings())
    app = create_http_app(runtime)

    @app.get("/v1/jobs/{job_id}")
    async def job(job_id: str) -> dict[str, str]:
        return {"job_id": job_id}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        def chunks() -> Iterator[bytes]:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app, runtime.registry


def count(registry: CollectorRegistry, method: str, route: str, status: str) -> float | None:
    labels = {"method": method, "route": route, "status_class": status}
    return registry.get_sample_value(METRIC, labels)


def test_requests_are_counted_by_route_template_and_status_class() -> None:
    app, registry = app_with_routes()
    client = TestClient(app, raise_server_exceptions=False)
    for job_id in ("j1", "j2", "j3"):
        assert client.get(f"/v1/jobs/{job_id}").status_code == 200
    assert client.get("/nowhere/j4").status_code == 404
    assert client.get("/boom").status_code == 500
    assert client.get("/stream").text.count("data:") == 2
    assert client.request("BREW", "/v1/jobs/j1").status_code == 405

    assert count(registry, "GET", "/v1/jobs/{job_id}", "2xx") == 3
    assert count(registry, "GET", "unmatched", "4xx") == 1
    assert count(registry, "GET", "/boom", "5xx") == 1
    assert count(registry, "GET", "/stream", "2xx") == 1
    assert count(registry, "other", "/v1/jobs/{job_id}", "4xx") == 1  # a 405 on that route
    served = {
        s.labels["route"] for m in registry.collect() for s in m.samples if "route" in s.labels
    }
    assert not any("j1" in route for route in served)


def test_status_classes() -> None:
    assert [status_class(s) for s in (101, 204, 302, 429, 503, 0)] == [
        "1xx",
        "2xx",
        "3xx",
        "4xx",
        "5xx",
        "other",
    ]
