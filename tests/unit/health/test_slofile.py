"""Reading the SLO file: the shipped example (against the metrics catalogue and the real
histograms' buckets), and every kind of mistake refused with a message naming the key."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Histogram

from schemas.health import Severity
from services.common.catalogue import read_catalogue
from services.common.consumer import DELAY_BUCKETS
from services.executor.metrics import STARTUP_BUCKETS
from services.health.slofile import (
    SliKind,
    SloFileError,
    catalogue_problems,
    format_duration,
    parse_slo_file,
)
from services.scheduler.handlers import WAIT_BUCKETS

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "slo.yaml"
# The bucket bounds of each histogram an SLI may use (where the code defines them).
BUCKETS = {
    "qm_scheduler_queue_wait_seconds": WAIT_BUCKETS,
    "qm_executor_startup_seconds": STARTUP_BUCKETS,
    "qm_consumer_record_delay_seconds": DELAY_BUCKETS,
    "qm_scheduler_cycle_seconds": Histogram.DEFAULT_BUCKETS,
}


def example_doc() -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert isinstance(doc, dict)
    return doc


def minimal(**slo: Any) -> dict[str, Any]:
    """One latency SLO with one page level; keyword arguments replace its keys."""
    base: dict[str, Any] = {
        "name": "cycle",
        "objective": 0.99,
        "period": "28d",
        "sli": {"kind": "latency", "metric": "qm_scheduler_cycle_seconds", "threshold_s": 0.25},
    }
    base.update(slo)
    return {
        "alerts": {
            "page": {
                "severity": "critical",
                "windows": [
                    {"long": "1h", "short": "5m", "burn_rate": 14.4},
                    {"long": "6h", "short": "30m", "burn_rate": 6},
                ],
            }
        },
        "slos": [base],
    }


def test_the_example_file_reads_and_names_only_catalogued_metrics_and_labels() -> None:
    slos = parse_slo_file(example_doc())
    names = [s.name for s in slos.slos]
    assert names == [
        "queue-wait-high",
        "scheduler-cycle",
        "placement-to-start",
        "metering-lag",
        "gateway-availability",
    ]
    catalogue = read_catalogue()
    assert catalogue is not None
    assert catalogue_problems(slos, catalogue) == []
    high = slos.slos[0]
    assert high.sli.labels == (("priority_class", "high"),)
    assert [lv.name for lv in high.levels] == ["page", "ticket"]
    assert [(p.long_s, p.short_s, p.burn_rate) for p in high.levels[0].pairs] == [
        (3600, 300, 14.4),
        (21600, 1800, 6.0),
    ]
    assert high.levels[1].severity is Severity.WARNING and high.period_s == 28 * 86400


def test_every_latency_threshold_of_the_example_is_a_bucket_bound() -> None:
    for slo in parse_slo_file(example_doc()).slos:
        if slo.sli.kind is SliKind.LATENCY:
            bounds = [float(b) for b in BUCKETS[slo.sli.metric]]
            assert slo.sli.threshold_s in bounds, slo.name


def test_an_slo_may_have_its_own_levels_and_the_errors_kind_reads_a_counter() -> None:
    doc = minimal(
        name="stalls",
        objective=0.9,
        sli={
            "kind": "errors",
            "metric": "qm_http_request_duration_seconds",
            "labels": {"route": "/v1/jobs"},
            "bad": {"status_class": "5xx"},
        },
        alerts={"ticket": {"severity": "warning", "windows": [{"long": "1d", "short": "2h",
                                                                "burn_rate": 2}]}},
    )  # fmt: skip
    [slo] = parse_slo_file(doc).slos
    assert [lv.name for lv in slo.levels] == ["ticket"]
    assert slo.sli.count_series == "qm_http_request_duration_seconds_count"
    assert slo.sli.bad == (("status_class", "5xx"),)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"objective": 1.0}, "objective: must be between 0 and 1"),
        ({"objective": 0}, "objective: must be between 0 and 1"),
        ({"objective": -0.5}, "objective: must be between 0 and 1"),
        ({"objective": math.nan}, "objective: must be a finite number"),
        ({"objective": math.inf}, "objective: must be a finite number"),
        ({"objective": "0.99"}, "objective: must be a number"),
        ({"objective": True}, "objective: must be a number"),
        ({"objective": None}, "objective: must be a number"),
        ({"period": "-1d"}, "period: a duration"),
        ({"period": "0s"}, "period: a duration"),
        ({"period": "1.5h"}, "period: a duration"),
        ({"period": 3600}, "period: a duration"),
        ({"period": "30m"}, "alert window 1h of level page is longer than the period 30m"),
        ({"name": "Cycle Time"}, "name: need lower-case letters"),
        ({"name": 7}, "name: need lower-case letters"),
        ({"services": "scheduler"}, "services: must be a list"),
        ({"objectiv": 0.9}, "unknown key(s) ['objectiv']"),
        ({"sli": {"kind": "latency", "metric": "qm_scheduler_cycle_seconds"}}, "threshold_s"),
        (
            {"sli": {"kind": "latency", "metric": "qm_x_seconds", "threshold_s": -1}},
            "threshold_s: must be above 0",
        ),
        (
            {"sli": {"kind": "latency", "metric": "qm_x_seconds", "threshold_s": math.nan}},
            "threshold_s: must be a finite number",
        ),
        (
            {"sli": {"kind": "latency", "metric": "qm_x_seconds_bucket", "threshold_s": 1}},
            "name the histogram, not its _bucket series",
        ),
        (
            {"sli": {"kind": "latency", "metric": "qm_x_total", "threshold_s": 1}},
            "a latency SLI needs a histogram",
        ),
        ({"sli": {"kind": "apdex", "metric": "qm_x"}}, "kind: one of ['latency', 'errors']"),
        ({"sli": {"kind": "latency", "metric": "up", "threshold_s": 1}}, "metric: a Quartermaster"),
        ({"sli": {"kind": "errors", "metric": "qm_x_total"}}, "bad: the labels that mark"),
        (
            {"sli": {"kind": "errors", "metric": "qm_x_total", "bad": {"code": 500}}},
            "bad.code: must be a text",
        ),
        (
            {
                "sli": {
                    "kind": "latency",
                    "metric": "qm_x_seconds",
                    "threshold_s": 1,
                    "labels": {"le": "1"},
                }
            },
            "'le' is not a label name",
        ),
        (
            {
                "sli": {
                    "kind": "latency",
                    "metric": "qm_x_seconds",
                    "threshold_s": 1,
                    "labels": {"q": 'a"b'},
                }
            },
            "labels.q: must be a text without quotes",
        ),
        ({"objective": 0.9}, "burn rate 14.4 of level page can never be exceeded"),
    ],
)
def test_a_bad_slo_is_refused_naming_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SloFileError) as caught:
        parse_slo_file(minimal(**change))
    assert message in str(caught.value)


def windows(*pairs: Any) -> dict[str, Any]:
    doc = minimal()
    doc["alerts"]["page"]["windows"] = list(pairs)
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (windows({"long": "5m", "short": "1h", "burn_rate": 14.4}), "must be shorter than"),
        (windows({"long": "5m", "short": "5m", "burn_rate": 14.4}), "must be shorter than"),
        (
            windows(
                {"long": "6h", "short": "30m", "burn_rate": 6},
                {"long": "1h", "short": "5m", "burn_rate": 14.4},
            ),
            "windows: out of order",
        ),
        (
            windows(
                {"long": "1h", "short": "5m", "burn_rate": 6},
                {"long": "6h", "short": "30m", "burn_rate": 14.4},
            ),
            "windows: out of order",
        ),
        (windows({"long": "1h", "short": "5m", "burn_rate": -2}), "burn_rate: must be above 0"),
        (windows({"long": "1h", "short": "5m", "burn_rate": math.inf}), "finite number"),
        (windows({"long": "1h", "short": "5m", "burn_rate": "fast"}), "must be a number"),
        (windows({"long": "1h", "short": "5m"}), "burn_rate: must be a number"),
        (windows(), "windows: must be a non-empty list"),
        (windows("1h"), "must be a mapping {long, short, burn_rate}"),
        ({**minimal(), "alerts": {"Page": {}}}, "level names are lower-case words"),
        (
            {**minimal(), "alerts": {"page": {"severity": "loud", "windows": []}}},
            "severity: one of",
        ),
        ({**minimal(), "alerts": []}, "alerts: must be a mapping of alert levels"),
        ({"slos": minimal()["slos"]}, "no alert levels"),
        ({**minimal(), "slos": []}, "slos: must be a non-empty list"),
        ({**minimal(), "slos": ["cycle"]}, "slos[0]: must be a mapping"),
        ({**minimal(), "dashboard": 3}, "dashboard: must be a text"),
        ({**minimal(), "extra": 1}, "top level: unknown key(s) ['extra']"),
        (["not", "a", "mapping"], "expected a mapping at the top level"),
    ],
)
def test_bad_alert_windows_and_file_shapes_are_refused(doc: Any, message: str) -> None:
    with pytest.raises(SloFileError) as caught:
        parse_slo_file(doc)
    assert message in str(caught.value)


def test_names_must_be_unique() -> None:
    doc = minimal()
    doc["slos"].append(copy.deepcopy(doc["slos"][0]))
    with pytest.raises(SloFileError, match=r"repeated: \['cycle'\]"):
        parse_slo_file(doc)


def test_the_catalogue_check_names_unknown_metrics_wrong_types_and_labels() -> None:
    catalogue = read_catalogue()
    assert catalogue is not None
    doc = minimal()
    doc["slos"] += [
        {**doc["slos"][0], "name": "ghost", "sli": {"kind": "latency",
         "metric": "qm_scheduler_teleport_seconds", "threshold_s": 1}},
        {**doc["slos"][0], "name": "gauge", "sli": {"kind": "errors",
         "metric": "qm_scheduler_pending_jobs", "bad": {"reason": "x"}}},
        {**doc["slos"][0], "name": "label", "sli": {"kind": "latency",
         "metric": "qm_scheduler_cycle_seconds", "threshold_s": 1, "labels": {"tenant": "a"}}},
    ]  # fmt: skip
    problems = catalogue_problems(parse_slo_file(doc), catalogue)
    assert problems == [
        "slos.ghost.sli.metric: qm_scheduler_teleport_seconds is not in docs/metrics.md",
        "slos.gauge.sli.metric: qm_scheduler_pending_jobs is a gauge; errors SLIs need a "
        "histogram or counter",
        "slos.gauge.sli: qm_scheduler_pending_jobs has no label 'reason' (it has [])",
        "slos.label.sli: qm_scheduler_cycle_seconds has no label 'tenant' (it has [])",
    ]


@pytest.mark.parametrize(
    ("seconds", "text"), [(30, "30s"), (90, "90s"), (300, "5m"), (3600, "1h"), (259200, "3d"),
                          (1209600, "2w")]
)  # fmt: skip
def test_durations_print_in_the_largest_whole_unit(seconds: int, text: str) -> None:
    assert format_duration(seconds) == text
