"""A service's shutdown ends even when one of its steps hangs: each close hook (and the lease's
release) gets `shutdown_step_s`, a hook past it is cut off with an error that names it, and the
hooks after it still run."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import structlog
from fastapi import FastAPI

from services.common.runtime import Runtime, in_daemon_thread
from services.common.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[3]


async def test_a_hanging_close_hook_is_cut_off_and_the_others_still_run() -> None:
    service = Runtime("t", ServiceSettings(shutdown_step_s=0.2))
    ran: list[str] = []
    never = asyncio.Event()

    async def first_registered() -> None:
        ran.append("first_registered")

    async def hangs() -> None:
        ran.append("hangs")
        while not never.is_set():
            try:
                await never.wait()
            except asyncio.CancelledError:
                continue  # the worst case: a step that ignores its cancellation as well

    async def fails() -> None:
        ran.append("fails")
        raise RuntimeError("the broker was already gone")

    # Hooks run in the reverse of their registration: fails, hangs, then first_registered.
    for hook in (first_registered, hangs, fails):
        service.on_shutdown(hook)
    with structlog.testing.capture_logs() as logs:
        async with asyncio.timeout(30):  # the bound under test is 0.2 s per step
            async with service.lifespan(FastAPI()):
                pass
    never.set()  # let the cut-off step end, so the test leaves no task behind
    await asyncio.sleep(0)
    assert ran == ["fails", "hangs", "first_registered"]
    here = f"{__name__}.test_a_hanging_close_hook_is_cut_off_and_the_others_still_run.<locals>"
    cut = [e for e in logs if e["event"] == "shutdown step did not finish; cut off"]
    assert [(e["step"], e["limit_s"]) for e in cut] == [(f"{here}.hangs", 0.2)]
    assert [e["step"] for e in logs if e["event"] == "shutdown step failed"] == [f"{here}.fails"]
    assert logs[-1]["event"] == "service stopped"


async def test_a_hook_that_is_no_coroutine_and_raises_does_not_stop_the_others() -> None:
    service = Runtime("t", ServiceSettings(shutdown_step_s=5))
    ran: list[str] = []

    async def after() -> None:
        ran.append("after")

    def broken() -> None:  # not even a coroutine function: it raises when called
        raise RuntimeError("closed twice")

    service.on_shutdown(after)
    service.on_shutdown(broken)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        async with service.lifespan(FastAPI()):
            pass
    assert ran == ["after"]
    assert [e["step"].rsplit(".", 1)[-1] for e in logs if e["event"] == "shutdown step failed"] == [
        "broken"
    ]


async def test_a_shutdown_that_is_itself_cancelled_cancels_its_step() -> None:
    service = Runtime("t", ServiceSettings(shutdown_step_s=60))
    entered, never = asyncio.Event(), asyncio.Event()
    outcome: list[str] = []

    async def slow() -> None:
        entered.set()
        try:
            await never.wait()
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise

    service.on_shutdown(slow)

    async def run() -> None:
        async with service.lifespan(FastAPI()):
            pass

    task = asyncio.create_task(run())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)  # the step's cancellation is delivered
    assert outcome == ["cancelled"]


# The end of each script below: the service's lifespan, run as a service process runs it.
LIFESPAN = """
async def main() -> None:
    async with service.lifespan(FastAPI()):
        pass
    print("lifespan over", flush=True)

asyncio.run(main())
"""


def run_alone(script: str) -> tuple[int, str]:
    """`script` in a fresh interpreter in the repository: its exit code and its output."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,  # only a bound on a broken test
    )
    return done.returncode, done.stdout + done.stderr


# A service's own process whose close hook ignores its cancellation: asyncio.run's close would
# wait for that task for ever; the process ends itself instead (exit code 1).
STUBBORN = (
    """
import asyncio
from fastapi import FastAPI
import services.common.runtime as runtime
from services.common.settings import ServiceSettings

runtime._own_process = True
service = runtime.Runtime("t", ServiceSettings(shutdown_step_s=0.3))

async def stubborn() -> None:
    while True:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            continue

service.on_shutdown(stubborn)
"""
    + LIFESPAN
    + """
print("never here: asyncio.run waits for the stubborn step", flush=True)
"""
)


def test_a_service_process_whose_step_ignores_cancellation_still_exits() -> None:
    returncode, output = run_alone(STUBBORN)  # ends ~0.6 s in
    assert returncode == 1, output
    assert "lifespan over" in output and "never here" not in output
    assert "a cut-off shutdown step is still running; exiting" in output


async def test_the_steps_together_end_by_the_shutdown_deadline() -> None:
    """Each step gets `shutdown_step_s` but no more than what is left of the deadline; the
    steps past it still start, with a tenth of a second each."""
    service = Runtime("t", ServiceSettings(shutdown_step_s=30, shutdown_deadline_s=0.5))
    ran: list[str] = []
    never = asyncio.Event()

    def hanging(name: str) -> Any:
        async def hook() -> None:
            ran.append(name)
            await never.wait()

        hook.__qualname__ = name
        return hook

    for name in ("c", "b", "a"):
        service.on_shutdown(hanging(name))
    with structlog.testing.capture_logs() as logs:
        async with asyncio.timeout(60):  # only a bound on a broken test
            async with service.lifespan(FastAPI()):
                pass
    assert ran == ["a", "b", "c"]
    cut = [e["limit_s"] for e in logs if e["event"] == "shutdown step did not finish; cut off"]
    assert len(cut) == 3
    assert cut[0] <= 0.5 and cut[1:] == [0.1, 0.1]


async def test_work_in_a_daemon_thread_is_awaited_or_left_behind() -> None:
    assert await in_daemon_thread(lambda: None) is None
    with pytest.raises(ValueError, match="bad"):
        await in_daemon_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))
    release = threading.Event()
    stuck = in_daemon_thread(release.wait)
    [thread] = [t for t in threading.enumerate() if t.name == "qm-wait"]
    assert thread.daemon  # an interpreter exits without waiting for it
    stuck.cancel()  # given up on: its late end is ignored
    release.set()
    thread.join(10)
    await asyncio.sleep(0)
    assert stuck.cancelled()


# A service's own process whose traces cannot be written (a collector that never answers):
# the flush is cut off and the process exits normally, where `asyncio.to_thread` left a
# thread that asyncio.run's close (and the interpreter's exit) waited for.
TRACES_HANG = (
    """
import asyncio, threading
from fastapi import FastAPI
import services.common.runtime as runtime
from services.common.settings import ServiceSettings

runtime._own_process = True
service = runtime.Runtime("t", ServiceSettings(shutdown_step_s=0.3))

class NeverWritten:
    def shutdown(self) -> None:
        threading.Event().wait()

service.tracing = NeverWritten()
"""
    + LIFESPAN
    + """
print("exited normally", flush=True)
"""
)


def test_a_trace_flush_that_never_ends_does_not_keep_a_process_alive() -> None:
    returncode, output = run_alone(TRACES_HANG)  # ends ~0.3 s in
    assert returncode == 0, output
    assert "exited normally" in output
    assert "shutdown step did not finish; cut off" in output and "write the traces" in output
