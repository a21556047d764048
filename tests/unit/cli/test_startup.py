"""`qm` starts quickly: the commands that only talk to the gateway (and `qm --help`) must not
import the dev stack's machinery, the simulator, numpy or the platform's service libraries.

Checked on the modules a fresh interpreter has loaded, not on timings, so that a busy machine
cannot make it fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.unit.cli.gateway_double import serving

ROOT = Path(__file__).resolve().parents[3]

# Never needed to list, parse or run a gateway command (cli.stack and what it imports: asyncio,
# the probes, process handling; the simulator and the scheduling core; numpy and matplotlib).
HEAVY = (
    "numpy",
    "matplotlib",
    "PIL",
    "asyncio",
    "concurrent",
    "core",
    "schemas",
    "services",
    "sim.engine",
    "sim.fleet",
    "sim.report",
    "sim.runner",
    "sim.variants",
    "sim.workload",
    "cli.stack",
    "cli.infra",
    "cli.probes",
    "cli.processes",
    "fastapi",
    "faststream",
    "aiokafka",
    "asyncpg",
    "redis",
)
# Needed only once a request is made (http.client, and ssl, which it imports) or a job file is
# read (yaml). httpx is not used by the gateway commands at all (`qm ps` and `qm fault` use it).
REQUEST_ONLY = ("http.client", "ssl", "yaml", "httpx", "httpcore")

SCRIPT = """
import json, sys
from cli.main import app
for argv in json.loads(sys.argv[1]):
    try:
        app(argv, prog_name="qm")
    except SystemExit:
        pass
print(json.dumps(sorted(sys.modules)))
"""


def loaded_after(*commands: list[str], tmp_path: Path) -> list[str]:
    """The modules loaded by a fresh interpreter that imports `qm` and runs ``commands``."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(commands)],
        cwd=ROOT,
        env={**os.environ, "QM_STATE_DIR": str(tmp_path), "COLUMNS": "100"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    modules: list[str] = json.loads(result.stdout.strip().splitlines()[-1])
    return modules


def among(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == n or m.startswith(f"{n}.") for n in names)]


# The modules that define commands; the root group imports one when its command is asked for.
COMMAND_MODULES = (
    "cli.jobs",
    "cli.usage",
    "cli.pools",
    "cli.fleet",
    "cli.services",
    "cli.robots",
    "cli.traces",
    "cli.faults",
    "sim.cli",
)


def test_importing_qm_loads_no_command_yet(tmp_path: Path) -> None:
    modules = loaded_after(tmp_path=tmp_path)
    assert "cli.main" in modules  # the check sees what it should
    assert among(modules, HEAVY + REQUEST_ONLY + COMMAND_MODULES) == []


def test_the_full_help_loads_every_command_and_nothing_heavy(tmp_path: Path) -> None:
    modules = loaded_after(["--help"], tmp_path=tmp_path)
    assert among(modules, COMMAND_MODULES) == sorted(COMMAND_MODULES)
    assert among(modules, HEAVY + REQUEST_ONLY) == []


@pytest.mark.parametrize(
    "command",
    [["list", "--help"], ["sim", "--help"], ["fault", "--help"], ["up", "--help"]],
)
def test_help_loads_nothing_heavy(command: list[str], tmp_path: Path) -> None:
    assert among(loaded_after(command, tmp_path=tmp_path), HEAVY + REQUEST_ONLY) == []


def test_a_gateway_command_loads_only_its_module_and_the_http_client(tmp_path: Path) -> None:
    # Port 1 refuses the connection: `qm list` fails, after having done all its work.
    modules = loaded_after(["list", "--gateway", "http://127.0.0.1:1"], tmp_path=tmp_path)
    assert "http.client" in modules  # it did try to reach the gateway
    assert among(modules, (*HEAVY, "httpx", "httpcore", "yaml", "typer", "pydantic")) == []
    assert among(modules, COMMAND_MODULES) == ["cli.jobs"]
    # Its table and its errors print without rich (cli.out): rich's console alone costs more
    # than click.
    assert among(modules, ("rich", "cli.render")) == []


def test_a_listing_of_jobs_prints_without_rich(tmp_path: Path) -> None:
    jobs = [{"job_id": f"j-{i}", "state": "queued", "tenant": "vision"} for i in range(50)]
    answer = httpx.Response(200, json={"jobs": jobs})
    with serving(lambda _request: answer) as double:
        modules = loaded_after(["list", "--gateway", double.url], tmp_path=tmp_path)
    assert len(double.requests) == 1  # it did fetch and show them
    assert among(modules, ("rich", "cli.render")) == []


def test_the_sim_default_policies_are_every_variant() -> None:
    from sim.cli import ALL_VARIANTS
    from sim.variants import VARIANTS

    assert ",".join(VARIANTS) == ALL_VARIANTS
