"""A service runs on uvloop unless QM_EVENT_LOOP=asyncio: `serve` hands the setting to uvicorn.
A value that is neither is refused when the settings are read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.common.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[3]

# `serve` as a service's __main__ calls it, with an app that reports its loop and stops itself.
SCRIPT = """
import asyncio, os, signal
from contextlib import asynccontextmanager
from fastapi import FastAPI
from services.common.runtime import serve
from services.common.settings import ServiceSettings

@asynccontextmanager
async def lifespan(app):
    print("loop:", type(asyncio.get_running_loop()).__module__, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    yield

serve(FastAPI(lifespan=lifespan), ServiceSettings(), "t")
"""


@pytest.mark.parametrize(
    ("setting", "module"), [(None, "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
def test_a_service_runs_on_the_loop_its_setting_names(setting: str | None, module: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "QM_EVENT_LOOP"}
    if setting is not None:
        env["QM_EVENT_LOOP"] = setting
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        env={**env, "QM_HTTP_PORT": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("loop:")]
    assert line.split()[1].split(".")[0] == module, done.stdout + done.stderr


def test_a_loop_that_is_not_one_of_the_two_is_refused() -> None:
    with pytest.raises(ValidationError, match="event_loop"):
        ServiceSettings(event_loop="tokio")  # type: ignore[arg-type]
