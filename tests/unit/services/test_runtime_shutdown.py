"""A service's shutdown ends even when one of its steps hangs: each close hook (and the lease's
release) gets `shutdown_step_s`, a hook past it is cut off with an error that names it, and the
hooks after it still run."""

from __future__ import annotations

import asyncio

import structlog
from fastapi import FastAPI

from services.common.runtime import Runtime
from services.common.settings import ServiceSettings


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
    cut = [e for e in logs if e["event"] == "shutdown step did not finish; cut off"]
    assert [(e["step"], e["limit_s"]) for e in cut] == [("hangs", 0.2)]
    assert [e["step"] for e in logs if e["event"] == "shutdown step failed"] == ["fails"]
    assert logs[-1]["event"] == "service stopped"
