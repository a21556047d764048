"""deploy/observability: the Prometheus rules and the Grafana dashboard are what the SLO file
generates, every expression parses as PromQL and names only metrics of docs/metrics.md, and
every alert reads recording rules that exist. And the checks fail when they should."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import promql_parser
import pytest
import yaml

from services.common.catalogue import read_catalogue
from services.health.slofile import SloFileError

ROOT = Path(__file__).resolve().parents[3]
SELECTOR_NAME = re.compile(r'name: Some\(\s*"([^"]+)"')
SUFFIXES = ("_bucket", "_count", "_sum")


def load_render() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "observability_render", ROOT / "deploy" / "observability" / "render.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load_render()


def committed_rules() -> dict[str, Any]:
    doc = yaml.safe_load(render.RULES_FILE.read_text())
    assert isinstance(doc, dict)
    return doc


def committed_dashboard() -> dict[str, Any]:
    doc = json.loads(render.DASHBOARD_FILE.read_text())
    assert isinstance(doc, dict)
    return doc


def expressions() -> list[str]:
    rules = [r["expr"] for g in committed_rules()["groups"] for r in g["rules"]]
    panels = [t["expr"] for p in committed_dashboard()["panels"] for t in p.get("targets", [])]
    return rules + panels


def selector_names(expr: str) -> set[str]:
    """The series every selector of the expression names, as the PromQL parser reads it."""
    return set(SELECTOR_NAME.findall(repr(promql_parser.parse(expr))))


def test_the_generated_files_are_current() -> None:
    assert render.stale() == [], "run: .venv/bin/python deploy/observability/render.py generate"


def test_every_expression_parses_and_names_only_catalogued_metrics() -> None:
    catalogue = read_catalogue()
    assert catalogue is not None
    recorded = {
        r["record"] for g in committed_rules()["groups"] for r in g["rules"] if "record" in r
    }
    unknown = set()
    names: set[str] = set()
    for expr in expressions():
        for name in selector_names(expr):
            names.add(name)
            if name in recorded:
                continue
            base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)
            entry = catalogue.get(base) or catalogue.get(name)
            if entry is None or (base != name and entry.type != "histogram"):
                unknown.add(name)
    assert unknown == set()
    # The SLIs and the platform panels are all there.
    assert {
        "qm_scheduler_queue_wait_seconds_bucket",
        "qm_scheduler_cycle_seconds_bucket",
        "qm_executor_startup_seconds_count",
        "qm_consumer_record_delay_seconds_bucket",
        "qm_http_request_duration_seconds_count",
        "qm_consumer_lag_records",
        "qm_consumer_dead_letters_total",
        "qm_fleet_accelerators",
    } <= names


def test_alerts_read_recording_rules_of_their_own_slo_and_match_the_file() -> None:
    slos = render.load()
    groups = {g["name"]: g["rules"] for g in committed_rules()["groups"]}
    assert sorted(groups) == sorted(f"slo-{s.name}" for s in slos.slos)
    for slo in slos.slos:
        rules = groups[f"slo-{slo.name}"]
        recorded = {r["record"] for r in rules if "record" in r}
        alerts = [r for r in rules if "alert" in r]
        assert [a["labels"]["level"] for a in alerts] == [lv.name for lv in slo.levels]
        for alert, level in zip(alerts, slo.levels, strict=True):
            assert alert["labels"]["severity"] == level.severity.value
            used = selector_names(alert["expr"])
            assert used <= recorded
            assert re.findall(r'slo="([^"]+)"', alert["expr"]) == [slo.name] * 2 * len(level.pairs)
            for pair in level.pairs:
                assert f"> ({pair.burn_rate:g} * {slo.error_budget:.6g})" in alert["expr"]


def test_the_dashboard_has_an_slo_row_each_and_the_platform_panels() -> None:
    board = committed_dashboard()
    titles = [p["title"] for p in board["panels"]]
    for slo in render.load().slos:
        assert any(t.startswith(f"SLO {slo.name}:") for t in titles)
    assert "Error budget remaining" in titles and "Accelerators by state" in titles
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_a_changed_slo_file_makes_both_files_stale(tmp_path: Path) -> None:
    doc = yaml.safe_load(render.SLO_FILE.read_text())
    doc["slos"][0]["objective"] = 0.96
    changed = tmp_path / "slo.yaml"
    changed.write_text(yaml.safe_dump(doc))
    assert render.stale(changed) == [render.RULES_FILE, render.DASHBOARD_FILE]
    assert "(14.4 * 0.04)" in render.generated(changed)[render.RULES_FILE]


def test_an_slo_on_an_unknown_metric_is_refused(tmp_path: Path) -> None:
    doc = yaml.safe_load(render.SLO_FILE.read_text())
    doc["slos"][0]["sli"]["metric"] = "qm_scheduler_teleport_seconds"
    bad = tmp_path / "slo.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(SloFileError, match="qm_scheduler_teleport_seconds is not in docs"):
        render.generated(bad)


def test_selector_names_sees_through_functions_and_aggregations() -> None:
    expr = 'histogram_quantile(0.9, sum by (le) (rate(qm_a_bucket{le="1.0"}[5m]))) / qm_b'
    assert selector_names(expr) == {"qm_a_bucket", "qm_b"}
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(qm_a[5m])")
