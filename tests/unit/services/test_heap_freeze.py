"""A service's own process freezes its start-up heap out of the garbage collector's reach once
start-up is done (unless QM_GC_FREEZE=0) and collects its young objects less often
(QM_GC_YOUNG_THRESHOLD); a runtime started inside another process (a test's) leaves that
process's collector alone."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI

from services.common.runtime import Runtime
from services.common.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[3]

# A runtime started as `serve` would (it marks the process as the service's own), no server.
SCRIPT = """
import asyncio, gc
from fastapi import FastAPI
import services.common.runtime as runtime
from services.common.settings import ServiceSettings

runtime._own_process = True
service = runtime.Runtime("t", ServiceSettings())

async def start():
    async with service.lifespan(FastAPI()):
        print(gc.get_freeze_count())
        print("threshold", *gc.get_threshold())

asyncio.run(start())
"""


@pytest.mark.parametrize(("setting", "frozen"), [("1", True), ("0", False)])
def test_a_service_process_freezes_its_heap_after_start_up(setting: str, frozen: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env={**os.environ, "QM_GC_FREEZE": setting},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (count,) = [int(line) for line in done.stdout.splitlines() if line.strip().isdigit()]
    assert (count > 10_000) is frozen, done.stdout  # the imports alone are tens of thousands
    assert ("heap frozen" in done.stdout + done.stderr) is frozen


def thresholds(env: dict[str, str]) -> tuple[int, ...]:
    inherited = {k: v for k, v in os.environ.items() if k != "QM_GC_YOUNG_THRESHOLD"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env={**inherited, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("threshold ")]
    return tuple(int(n) for n in line.split()[1:])


def test_a_service_process_collects_young_objects_less_often() -> None:
    default = ServiceSettings().gc_young_threshold
    assert default > 700  # Python's own
    young, *older = thresholds({})
    assert young == default
    assert older == [10, 10]  # the older generations' stay Python's
    assert thresholds({"QM_GC_YOUNG_THRESHOLD": "700"})[0] == 700


def test_a_runtime_inside_another_process_leaves_its_collector_alone() -> None:
    before = gc.get_freeze_count()
    threshold = gc.get_threshold()
    service = Runtime("t", ServiceSettings(gc_young_threshold=50_000))

    async def start() -> None:
        async with service.lifespan(FastAPI()):
            pass

    asyncio.run(start())
    assert gc.get_freeze_count() == before
    assert gc.get_threshold() == threshold
