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


def test_the_example_straggler_section_is_the_defaults() -> None:
    s = example().straggler
    assert (s.slowdown, s.n, s.m, s.quarantine, s.severity) == (1.5, 3, 5, False, Severity.WARNING)
    assert s.action_for("gpu-7", "job-1", 2, 2.8) == (
        "Node gpu-7 runs job job-1's replica 2 2.8x slower than its peers; "
        "drain it after the job checkpoints, and check thermal and PCIe."
    )


def test_without_a_straggler_section_the_defaults_apply() -> None:
    s = HealthRules.from_dict({}).straggler
    assert (s.slowdown, s.n, s.m, s.quarantine, s.expire_after_s) == (1.5, 3, 5, False, 60.0)


def test_a_straggler_quarantine_uses_its_own_clean_period() -> None:
    rules = HealthRules.from_dict({"straggler": {"quarantine": True, "clean_period_s": 900}})
    assert rules.straggler.quarantine and rules.clean_period_for("straggler") == 900
    assert HealthRules.from_dict({}).clean_period_for("straggler") == 120


@pytest.mark.parametrize(
    ("section", "says"),
    [
        ({"slowdown": 1.0}, "slowdown must be > 1"),
        ({"slowdown": "fast"}, "slowdown must be a number"),
        ({"slowdown": True}, "slowdown must be a number"),
        ({"n": 6, "m": 5}, "need 1 <= n <= m"),
        ({"n": 0}, "need 1 <= n <= m"),
        ({"m": 1000, "n": 3}, "need 1 <= n <= m <= 100"),
        ({"n": 2.5}, "n must be a whole number"),
        ({"m": True}, "m must be a whole number"),
        ({"quarantine": "no"}, "quarantine must be true or false"),
        ({"expire_after_s": 0}, "expire_after_s must be > 0"),
        ({"severity": "loud"}, "severity"),
        ({"suggested_action": "drain {host}"}, "bad placeholder"),
        ({"slowdwon": 2}, "unknown key(s) ['slowdwon']"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_a_bad_straggler_section_is_refused_with_a_clear_error(section: object, says: str) -> None:
    with pytest.raises(ValueError, match=r"^straggler: ") as err:
        HealthRules.from_dict({"straggler": section})
    assert says in str(err.value)


def test_no_rule_may_take_the_straggler_name() -> None:
    with pytest.raises(ValueError, match="straggler"):
        HealthRules.from_dict(
            {"rules": [{"name": "straggler", "kind": "gpu_xid", "critical": True}]}
        )
