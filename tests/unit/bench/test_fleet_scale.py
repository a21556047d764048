"""bench/fleet_scale.py drives the services' handlers through entry points a refactor could
change (Executor.process on memory doubles, HealthMonitor._committed, Meter.tick): run it at
a tiny size so such a change breaks a test, not the bench, and check what it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.fleet_scale import FIGURES

ROOT = Path(__file__).resolve().parents[3]


def test_the_bench_runs_and_reports_every_figure_at_every_size() -> None:
    out = subprocess.run(
        [sys.executable, "bench/fleet_scale.py", "--sizes", "8,20", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["bench"] == "fleet_scale"
    assert figures["setup"]["sizes"] == [8, 20]
    for key in FIGURES:
        assert set(figures[key]) == {"8", "20"}, key
        assert all(v > 0 for v in figures[key].values()), key
