"""`qm sim` end to end on a small generic workload: tables printed, files and plots written."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from sim.cli import sim
from sim.workload import write_generic
from tests.sim.test_scenarios import synthetic

ROOT = Path(__file__).resolve().parents[2]


def test_sim_command_writes_figures(tmp_path: Path) -> None:
    trace = tmp_path / "w.csv"
    write_generic(trace, synthetic(200, seed=4, pool_gpus=32, load=0.9))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        sim,
        [
            "--trace",
            str(trace),
            "--policy",
            str(ROOT / "examples/policy.yaml"),
            "--pool",
            "4x8",
            "--policies",
            "fifo,default",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "offered load" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"fifo", "default"}
    assert summary["policies"]["default"]["overcommit"] == 0
    for name in (
        "jobs.csv",
        "utilization.csv",
        "jct_cdf.png",
        "utilization.png",
        "tenant_share.png",
    ):
        assert (out / name).stat().st_size > 0


def test_sim_command_explains_bad_input(tmp_path: Path) -> None:
    result = CliRunner().invoke(sim, ["--trace", str(tmp_path / "missing.csv")])
    assert result.exit_code == 2
    assert "not found" in result.output
    trace = tmp_path / "w.csv"
    write_generic(trace, synthetic(5, seed=1, pool_gpus=8, load=0.5))
    result = CliRunner().invoke(sim, ["--trace", str(trace), "--policies", "nope"])
    assert result.exit_code == 2
    assert "unknown policy" in result.output
