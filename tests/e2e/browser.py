"""A real browser for the dashboard's tests: Playwright driving the machine's Chromium (no
browser download; `apt-get install chromium`, or QM_CHROMIUM=/path/to/chromium).

Without a Chromium the browser tests skip with that advice, unless QM_REQUIRE_BROWSER is set
(CI sets it: there a missing browser is a failure, not a skip).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "test-artifacts" / "screenshots"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str | None:
    for candidate in (os.environ.get("QM_CHROMIUM"), "chromium", "chromium-browser"):
        if candidate and (found := shutil.which(candidate)):
            return found
    return None


def need_chromium() -> str:
    path = chromium_path()
    if path is None:
        advice = "no Chromium on this machine: apt-get install chromium (or set QM_CHROMIUM)"
        if os.environ.get("QM_REQUIRE_BROWSER"):
            pytest.fail(advice)
        pytest.skip(advice)
    return path


class Troubles:
    """What went wrong in the page that no assertion looks at: script errors, failed loads."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def watch(self, page: Any) -> None:
        page.on("pageerror", lambda e: self.seen.append(f"script error: {e}"))
        page.on(
            "console",
            lambda m: (
                self.seen.append(f"console {m.type}: {m.text}")
                if m.type == "error" and "Failed to load resource" not in m.text
                else None
            ),
        )

        def answered(response: Any) -> None:
            # Refusals a test provokes on purpose (a 400, a 404 page) it asserts itself;
            # a resource of the page itself must always load.
            if response.status >= 500 or (
                response.status >= 400 and response.request.resource_type != "document"
            ):
                self.seen.append(f"{response.status} {response.url}")

        page.on("response", answered)


@asynccontextmanager
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    path = need_chromium()
    async with async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=path, args=FLAGS)
        try:
            yield chromium
        finally:
            await chromium.close()


async def signed_in(chromium: Any, base_url: str, token: str) -> tuple[Any, Any, Troubles]:
    """A fresh context signed in through the login form with `token`."""
    context = await chromium.new_context(
        base_url=base_url, viewport={"width": 1500, "height": 1000}
    )
    page = await context.new_page()
    troubles = Troubles()
    troubles.watch(page)
    await page.goto("/ui/jobs")
    assert "/ui/login" in page.url  # no session yet: sent to sign in, then back
    await page.fill("#token", token)
    await page.click("button[type=submit]")
    await page.wait_for_url(re.compile(r".*/ui/jobs$"))
    return context, page, troubles


async def screenshot(page: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
