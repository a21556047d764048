"""Reading the rule file: the shipped example, matching order and mistakes refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from schemas.health import Severity, SignalKind
from services.health.rules import HealthRules

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "health.yaml"


def example() -> HealthRules:
    return HealthRules.from_dict(yaml.safe_load(EXAMPLE.read_text()))


@pytest.mark.parametrize(
    ("kind", "xid", "rule", "critical"),
    [
        (SignalKind.GPU_XID, 79, "xid_79", True),
        (SignalKind.GPU_XID, 48, "xid_48", True),
        (SignalKind.GPU_XID, 13, "xid_other", False),
        (SignalKind.GPU_XID, None, "xid_other", False),
        (SignalKind.ECC_UNCORRECTABLE, None, "ecc_uncorrectable", True),
        (SignalKind.NVLINK_DOWN, None, "nvlink_down", True),
        (SignalKind.THERMAL_THROTTLE, None, "thermal_throttle", False),
        (SignalKind.PCIE_ERROR, None, "pcie_error", False),
        (SignalKind.DISK_FULL, None, "disk_full", False),
    ],
)
def test_the_example_file_judges_every_signal_kind(
    kind: SignalKind, xid: int | None, rule: str, critical: bool
) -> None:
    got = example().match(kind, xid)
    assert got is not None and (got.name, got.critical) == (rule, critical)


def test_the_example_timings_fit_a_five_second_heartbeat() -> None:
    t = example().timings
    assert (t.suspect_after_s, t.unhealthy_after_s) == (15, 30)
    assert example().clean_period_for("xid_79") == 1800
    assert example().clean_period_for("thermal_throttle") == t.clean_period_s


def test_settings_override_the_file_timings() -> None:
    rules = example().with_timings(unhealthy_after_s=2, suspect_after_s=1, clean_period_s=None)
    assert (rules.timings.suspect_after_s, rules.timings.unhealthy_after_s) == (1, 2)
    assert rules.timings.clean_period_s == 120


@pytest.mark.parametrize(
    "doc",
    [
        {"rules": [{"name": "x", "kind": "gpu_xid"}]},  # transient without a window
        {"rules": [{"name": "x", "kind": "bogus", "critical": True}]},
        {"rules": [{"kind": "gpu_xid", "critical": True}]},  # no name
        {"rules": [{"name": "heartbeat_lost", "kind": "gpu_xid", "critical": True}]},
        {"timings": {"suspect_after_s": 40, "unhealthy_after_s": 30}},
        {
            "rules": [
                {"name": "x", "kind": "gpu_xid", "critical": True},
                {"name": "x", "kind": "nvlink_down", "critical": True},
            ]
        },
    ],
)
def test_a_bad_rule_file_is_refused(doc: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        HealthRules.from_dict(doc)


def test_severity_defaults_to_warning() -> None:
    rules = HealthRules.from_dict(
        {"rules": [{"name": "t", "kind": "thermal_throttle", "threshold": 2, "window_s": 10}]}
    )
    assert rules.rules[0].severity == Severity.WARNING
