"""docs/metrics.md is what /metrics serves: each service's app is built as it starts (no
network: nothing connects before the lifespan runs) and the metrics it registers, with their
label names and types, must be exactly the catalogue's rows for that service, both ways."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.common.housekeeping import Housekeeping

CATALOGUE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
# Catalogue name -> the module whose create_app() builds the service.
SERVICES = {
    "gateway": "services.gateway.app",
    "queue": "services.queue.app",
    "scheduler": "services.scheduler.app",
    "preemptor": "services.preemptor.app",
    "executor": "services.executor.app",
    "edge": "services.executor.edge.app",
    "health": "services.health.app",
    "meter": "services.meter.app",
    "autoscaler": "services.autoscaler.app",
    "serving": "services.serving.app",
}
EVERY_SERVICE = "every service"
# Label names that would make a series per job, person, machine or request.
UNBOUNDED = {"job_id", "job", "user", "user_id", "node", "node_id", "run_id", "run", "path"}
ROW = re.compile(
    r"^\| `(?P<name>qm_[a-z0-9_]+)` \| (?P<type>counter|gauge|histogram) \| "
    r"(?P<labels>[^|]*) \| (?P<services>[^|]*) \|"
)

Entry = tuple[str, tuple[str, ...]]  # type, label names


def parse_catalogue(text: str) -> dict[str, dict[str, Entry]]:
    """service -> metric name -> (type, label names), from the catalogue's table rows."""
    out: dict[str, dict[str, Entry]] = {s: {} for s in SERVICES}
    seen: set[str] = set()
    for line in text.splitlines():
        match = ROW.match(line)
        if match is None:
            assert not line.startswith("| `qm_"), f"catalogue row not understood: {line}"
            continue
        name = match["name"]
        assert name not in seen, f"{name} has two rows in the catalogue"
        seen.add(name)
        labels_cell = match["labels"].strip()
        labels = () if labels_cell == "—" else tuple(re.findall(r"`([a-z_]+)`", labels_cell))
        cell = match["services"].strip()
        services = list(SERVICES) if cell == EVERY_SERVICE else [s.strip() for s in cell.split(",")]
        for service in services:
            assert service in out, f"{name}: unknown service {service!r}"
            out[service][name] = (match["type"], labels)
    return out


def served_name(collector: Any) -> str:
    kind = collector._type
    return str(collector._name) + ("_total" if kind == "counter" else "")


def registry_entries(registry: CollectorRegistry) -> dict[str, Entry]:
    out = {}
    for collector in registry._collector_to_names:
        out[served_name(collector)] = (collector._type, tuple(collector._labelnames))
    return out


def service_registry(module_name: str) -> CollectorRegistry:
    """The registry the service serves: what create_app registers, plus the housekeeping
    counter of services that start it with their stores (it needs the open pool)."""
    module = importlib.import_module(module_name)
    app = module.create_app()
    registry: CollectorRegistry = app.state.runtime.registry
    source = inspect.getsource(module)
    if "open_outboxed(" in source or "start_housekeeping(" in source:
        Housekeeping(pool=None, pruners={}, registry=registry)  # type: ignore[arg-type]
    return registry


@pytest.fixture(scope="module")
def catalogue() -> dict[str, dict[str, Entry]]:
    return parse_catalogue(CATALOGUE.read_text())


@pytest.fixture(scope="module")
def served() -> dict[str, dict[str, Entry]]:
    return {s: registry_entries(service_registry(m)) for s, m in SERVICES.items()}


@pytest.mark.parametrize("service", list(SERVICES))
def test_each_service_serves_exactly_its_catalogue_rows(
    service: str, catalogue: dict[str, dict[str, Entry]], served: dict[str, dict[str, Entry]]
) -> None:
    documented, serving = catalogue[service], served[service]
    missing = sorted(set(serving) - set(documented))
    stale = sorted(set(documented) - set(serving))
    assert not missing, f"{service} serves metrics docs/metrics.md does not list: {missing}"
    assert not stale, f"docs/metrics.md lists metrics {service} does not serve: {stale}"
    for name, (kind, labels) in serving.items():
        assert documented[name] == (kind, labels), (
            f"{service} {name}: serves {kind} {labels}, catalogue says {documented[name]}"
        )


def test_no_metric_has_an_unbounded_label(served: dict[str, dict[str, Entry]]) -> None:
    bad = sorted(
        (service, name, label)
        for service, entries in served.items()
        for name, (_, labels) in entries.items()
        for label in labels
        if label in UNBOUNDED
    )
    assert not bad


def test_the_parser_sees_every_row_and_reads_labels_and_services() -> None:
    text = "\n".join(
        [
            "| Metric | Type | Labels | Services | Meaning |",
            "| `qm_a_total` | counter | `tenant`, `reason` | queue, meter | A. |",
            "| `qm_b` | gauge | — | every service | B. |",
        ]
    )
    parsed = parse_catalogue(text)
    assert parsed["queue"]["qm_a_total"] == ("counter", ("tenant", "reason"))
    assert parsed["meter"]["qm_a_total"] == ("counter", ("tenant", "reason"))
    assert "qm_a_total" not in parsed["scheduler"]
    assert all(parsed[s]["qm_b"] == ("gauge", ()) for s in SERVICES)
    with pytest.raises(AssertionError, match="not understood"):
        parse_catalogue("| `qm_c` | summary | — | queue | C. |")
