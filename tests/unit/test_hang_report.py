"""A test phase that hangs fails with a message that says where it waits (tests/conftest.py):
a CI summary that shows only the failure's message still names the awaits that never ended."""

from __future__ import annotations

import asyncio
import re
import sys

from tests.conftest import waiting_on


async def stuck_on(event: asyncio.Event) -> None:
    await event.wait()


async def outer(event: asyncio.Event) -> None:
    await stuck_on(event)


async def test_the_report_names_each_tasks_awaits_outermost_first() -> None:
    event = asyncio.Event()
    task = asyncio.create_task(outer(event), name="probe")
    await asyncio.sleep(0)  # let it reach its wait
    try:
        report = waiting_on(sys._getframe())
    finally:
        event.set()
        await task
    assert report.startswith("main thread at test_hang_report.py:")
    probe = next(part for part in report.split("; ") if part.startswith("task probe:"))
    assert probe.index(" outer") < probe.index(" stuck_on")
    assert "test_the_report_names_each_tasks_awaits_outermost_first" in report


def test_outside_an_event_loop_only_the_frame_is_named() -> None:
    report = waiting_on(sys._getframe())
    assert re.fullmatch(
        r"main thread at test_hang_report\.py:\d+ "
        r"test_outside_an_event_loop_only_the_frame_is_named",
        report,
    )
