"""The dashboard in a real browser (Chromium through Playwright) against the whole platform:
signing in, following a job live through the jobs table and its own page, filtering,
grouping, paging and exporting, the reason a job waits, tenant isolation, and every view
rendering without a script error. Screenshots land in test-artifacts/screenshots/."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from playwright.async_api import expect

from cli.stack import Stack
from tests.e2e.browser import browser, screenshot, signed_in

VISION = {"Authorization": "Bearer dev-vision"}
NLP = {"Authorization": "Bearer dev-nlp"}
ADMIN = {"Authorization": "Bearer dev-admin"}
WAIT_MS = 30_000  # the longest a live change may take to show (it takes well under a second)


@pytest.fixture(scope="module")
async def chromium() -> AsyncIterator[Any]:
    async with browser() as b:
        yield b


@pytest.fixture
async def api(qm_stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    # Idle connections are dropped before uvicorn's 5 s keep-alive ends them: reusing one the
    # server is closing at that moment fails the request with a ReadError.
    limits = httpx.Limits(keepalive_expiry=2.0)
    async with httpx.AsyncClient(
        base_url=qm_stack.gateway_url, timeout=10, limits=limits
    ) as client:
        yield client


def body(project: str, name: str, *, seconds: int = 60, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "project": project,
        "resources": {"accelerators": 1, "accelerator_types": ["H100", "A100"]},
        "labels": {"sim_duration_s": str(seconds)},
        **extra,
    }


async def submit(api: httpx.AsyncClient, headers: dict[str, str], job: dict[str, Any]) -> str:
    r = await api.post("/v1/jobs", json=job, headers=headers)
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


async def wait_state(
    api: httpx.AsyncClient, job_id: str, states: set[str], timeout_s: float = 60
) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        r = await api.get(f"/v1/jobs/{job_id}", headers=ADMIN)
        if r.status_code == 200 and r.json()["state"] in states:
            return dict(r.json())
        assert asyncio.get_running_loop().time() < deadline, f"{job_id}: {r.text}"
        await asyncio.sleep(0.2)


async def test_a_job_is_followed_live_in_the_table_and_on_its_page(
    chromium: Any, api: httpx.AsyncClient, qm_stack: Stack
) -> None:
    project = f"live-{uuid.uuid4().hex[:8]}"
    first = await submit(api, VISION, body(project, "long-one", seconds=600_000))
    await wait_state(api, first, {"running"})

    context, page, troubles = await signed_in(chromium, qm_stack.gateway_url, "dev-vision")
    await page.goto(f"/ui/jobs?project={project}")
    row = page.locator(f"#job-{first}")
    await expect(row.locator(f"#c-{first}-state")).to_contain_text("running")
    await row.evaluate("el => { el.dataset.marker = 'kept'; }")
    # The live stream follows every change before anything else happens.
    await page.wait_for_selector("body[data-live=ready]", state="attached")

    # A new job of this filter is not pushed into the table: a banner counts it.
    second = await submit(api, VISION, body(project, "second", seconds=600_000))
    await expect(page.locator("#changes-banner")).to_contain_text("change", timeout=WAIT_MS)
    assert await page.locator(f"#job-{second}").count() == 0

    # Cancelling from the table: the row changes in place, where it was.
    page.on("dialog", lambda d: asyncio.ensure_future(d.accept()))
    await row.locator("input[name=job_id]").check()
    await page.click("[data-testid=cancel-selected]")
    await expect(page.locator("[data-testid=cancel-result]")).to_contain_text(
        "1 cancel request sent"
    )
    await expect(row.locator(f"#c-{first}-state")).to_contain_text("canceled", timeout=WAIT_MS)
    assert await page.locator("tr[data-marker=kept]").get_attribute("id") == f"job-{first}"
    assert (
        await page.locator("[data-testid=jobs] tbody tr").first.get_attribute("id")
        == f"job-{first}"
    )
    await screenshot(page, "jobs-live")

    # Applying the banner shows the new job; the audit trail names who cancelled.
    await page.click("#changes-banner a")
    await expect(page.locator(f"#job-{second}")).to_be_visible()
    await expect(page.locator("[data-testid=audit]")).to_contain_text(first)
    await expect(page.locator("[data-testid=audit]")).to_contain_text(
        "vision/user via the dashboard"
    )

    # The second job's page follows it to its end without a reload.
    await page.goto(f"/ui/jobs/{second}")
    await expect(page.locator("[data-testid=job-state]")).to_have_text("running", timeout=WAIT_MS)
    await page.click("text=Cancel this job")
    await expect(page.locator("[data-testid=job-state]")).to_have_text("canceled", timeout=WAIT_MS)
    timeline = page.locator("[data-testid=timeline] li")
    await expect(timeline.last).to_contain_text("canceled", timeout=WAIT_MS)
    types = await page.locator("[data-testid=timeline] li > span:nth-child(2)").all_inner_texts()
    assert types[:4] == ["JobSubmitted", "JobQueued", "PlacementDecided", "JobStarted"]
    history = (await api.get(f"/v1/jobs/{second}/events", headers=VISION)).json()
    assert len(types) == len(history)  # every line once, none twice
    await screenshot(page, "job-detail")
    assert troubles.seen == []
    await context.close()


async def test_filter_group_page_and_export(
    chromium: Any, api: httpx.AsyncClient, qm_stack: Stack
) -> None:
    project = f"pages-{uuid.uuid4().hex[:8]}"
    ids = [
        await submit(api, VISION, body(project, f"p{i}", queue="batch" if i % 3 else "default"))
        for i in range(30)
    ]
    for job_id in ids:
        await wait_state(api, job_id, {"queued", "placed", "running", "succeeded"})

    context, page, troubles = await signed_in(chromium, qm_stack.gateway_url, "dev-vision")
    await page.goto(f"/ui/jobs?project={project}&limit=25")
    first_page = await page.locator("[data-testid=jobs] tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.job)"
    )
    assert len(first_page) == 25
    assert first_page == list(reversed(ids))[:25]  # submitted one after another: newest first
    await page.click("[data-testid=next]")
    second_page = await page.locator("[data-testid=jobs] tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.job)"
    )
    assert len(second_page) == 5
    assert set(first_page) | set(second_page) == set(ids)
    await page.click("[data-testid=prev]")
    again = await page.locator("[data-testid=jobs] tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.job)"
    )
    assert again == first_page

    # The filter form keeps its state in the URL.
    await page.fill("input[name=queue]", "default")
    await page.click("form.filters button[type=submit]")
    await expect(page).to_have_url(re.compile(r"queue=default"))
    default = await page.locator("[data-testid=jobs] tbody tr").count()
    assert default == 10

    await page.goto(f"/ui/jobs?project={project}&group=queue")
    groups = page.locator("[data-testid=groups] tr")
    counts = {
        (await g.locator("td").nth(0).inner_text()): int(await g.locator("td").nth(1).inner_text())
        for g in await groups.all()
        if await g.locator("td").count()
    }
    assert counts == {"batch": 20, "default": 10}
    await screenshot(page, "jobs-grouped")

    answer = await page.request.get(f"/ui/jobs.csv?project={project}")
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(await answer.text())))
    assert sorted(r["job_id"] for r in rows) == sorted(ids)
    assert {r["tenant"] for r in rows} == {"vision"}
    assert troubles.seen == []
    await context.close()


async def test_a_pending_job_says_why_as_qm_explain_does(
    chromium: Any, api: httpx.AsyncClient, qm_stack: Stack
) -> None:
    # More CPU and memory per replica than any node has: it can never be placed.
    huge = body(f"why-{uuid.uuid4().hex[:8]}", "too-big", seconds=60)
    huge["resources"] = {
        "accelerators": 8,
        "accelerator_types": ["H100"],
        "cpu": 500,
        "memory_gb": 4000,
    }
    job_id = await submit(api, VISION, huge)
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        why = (await api.get(f"/v1/jobs/{job_id}/explain", headers=VISION)).json()
        if why["codes"] != ["awaiting_cycle"]:
            break
        assert asyncio.get_running_loop().time() < deadline, why
        await asyncio.sleep(0.3)

    context, page, troubles = await signed_in(chromium, qm_stack.gateway_url, "dev-vision")
    await page.goto(f"/ui/jobs/{job_id}")
    codes = await page.locator("[data-testid=why-codes] span").all_inner_texts()
    assert codes == why["codes"]
    await expect(page.locator("[data-testid=why-message]")).to_have_text(why["message"])
    await expect(page.locator("[data-testid=why]")).to_contain_text("among vision's waiting jobs")
    await screenshot(page, "job-pending")
    assert troubles.seen == []
    await context.close()
    r = await api.delete(f"/v1/jobs/{job_id}", headers=VISION)
    assert r.status_code == 202


async def test_one_tenant_cannot_see_another(
    chromium: Any, api: httpx.AsyncClient, qm_stack: Stack
) -> None:
    project = f"iso-{uuid.uuid4().hex[:8]}"
    theirs = await submit(api, NLP, body(project, "nlp-secret"))
    ours = await submit(api, VISION, body(project, "vision-own"))
    await wait_state(api, theirs, {"queued", "placed", "running", "succeeded"})
    await wait_state(api, ours, {"queued", "placed", "running", "succeeded"})

    context, page, troubles = await signed_in(chromium, qm_stack.gateway_url, "dev-vision")
    await page.goto(f"/ui/jobs?project={project}")
    shown = await page.locator("[data-testid=jobs] tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.job)"
    )
    assert shown == [ours]
    answer = await page.goto(f"/ui/jobs?tenant=nlp&project={project}")
    assert answer is not None and answer.status == 400
    await expect(page.locator("[role=alert]")).to_contain_text("may only see tenant 'vision'")
    answer = await page.goto(f"/ui/jobs/{theirs}")
    assert answer is not None and answer.status == 404
    grouped = await page.goto(f"/ui/jobs?project={project}&group=tenant")
    assert (
        grouped is not None and "nlp" not in await page.locator("[data-testid=groups]").inner_text()
    )
    csv_text = await (await page.request.get(f"/ui/jobs.csv?project={project}")).text()
    assert theirs not in csv_text and ours in csv_text

    # A change needs the page's CSRF token as well as the cookie.
    forged = await page.request.post(
        "/ui/jobs/cancel",
        data=f"job_id={ours}",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert forged.status == 403
    # More jobs than a bulk action takes at once is refused whole, with the limit.
    csrf = json.loads(await page.locator("body").get_attribute("hx-headers") or "{}")["X-QM-CSRF"]
    too_many = await page.request.post(
        "/ui/jobs/cancel",
        data="&".join(f"job_id=j{i}" for i in range(600)),
        headers={"content-type": "application/x-www-form-urlencoded", "x-qm-csrf": csrf},
    )
    assert too_many.status == 400 and "at most 500" in await too_many.text()
    # The API's bearer header works on the dashboard as well, with that token's scope.
    as_nlp = await page.request.get(
        f"/ui/jobs?project={project}", headers={"Authorization": "Bearer dev-nlp"}
    )
    assert as_nlp.status == 200 and theirs in await as_nlp.text()
    assert troubles.seen == []
    await context.close()

    # A wrong token is told so; no cookie is set.
    fresh = await chromium.new_context(base_url=qm_stack.gateway_url)
    login = await fresh.new_page()
    await login.goto("/ui/login")
    await login.fill("#token", "not-a-token")
    await login.click("button[type=submit]")
    await expect(login.locator("[role=alert]")).to_contain_text("not known")
    assert [c for c in await fresh.cookies() if c["name"] == "qm_session"] == []
    await fresh.close()


async def test_every_view_renders_for_an_operator(
    chromium: Any, api: httpx.AsyncClient, qm_stack: Stack
) -> None:
    await submit(api, VISION, body(f"views-{uuid.uuid4().hex[:8]}", "for-the-views"))
    context, page, troubles = await signed_in(chromium, qm_stack.gateway_url, "dev-admin")
    for path, name, marker in (
        ("/ui/", "overview", "[data-testid=jobs-by-state]"),
        ("/ui/jobs", "jobs", "[data-testid=jobs]"),
        ("/ui/jobs?group=tenant", "jobs-by-tenant", "[data-testid=groups]"),
        ("/ui/cost", "cost", "[data-testid=cost]"),
        ("/ui/cost?by=type&window=week", "cost-by-type", "[data-testid=cost]"),
        ("/ui/scheduler", "scheduler", "[data-testid=cycle]"),
    ):
        answer = await page.goto(path)
        assert answer is not None and answer.status == 200, path
        await expect(page.locator(marker)).to_be_visible()
        await screenshot(page, name)
    # The leading scheduler is found among the services' /metrics.
    await page.goto("/ui/scheduler")
    await expect(page.locator("[data-testid=cycle]")).to_contain_text("scheduler")
    await expect(page.locator("[data-testid=consumers]")).to_contain_text("queue-lifecycle")
    assert troubles.seen == []
    await context.close()


async def test_a_node_fault_turns_its_cells_quarantined(
    chromium: Any, api: httpx.AsyncClient, qm_stack: Stack
) -> None:
    idle = (await api.get("/v1/nodes", params={"state": "idle"}, headers=ADMIN)).json()["nodes"]
    by_cluster: dict[str, list[str]] = {}
    for n in idle:
        by_cluster.setdefault(n["cluster"], []).append(n["node_id"])
    cluster = max(by_cluster, key=lambda c: len(by_cluster[c]))
    victim = sorted(by_cluster[cluster])[-1]
    executor = next(
        s for s in qm_stack.services if s.extra_env.get("QM_EXECUTOR_CLUSTER") == cluster
    )

    context, page, troubles = await signed_in(chromium, qm_stack.gateway_url, "dev-ops")
    await page.goto(f"/ui/fleet?cluster={cluster}")
    node = page.locator(f"[data-node='{victim}']")
    await expect(node).not_to_have_attribute("data-state", "quarantined")

    # XID 79 (fell off the bus): quarantined at once, for its rule's 30-minute clean period
    # (examples/health.yaml), longer than this test looks.
    r = await api.post(
        f"http://127.0.0.1:{executor.port}/faults/node", json={"node_id": victim, "xid": 79}
    )
    assert r.status_code == 202, r.text
    # The page reloads itself every few seconds: no navigation here.
    await expect(node).to_have_attribute("data-state", "quarantined", timeout=WAIT_MS)
    states = await node.locator("[data-device-state]").evaluate_all(
        "cells => cells.map(c => c.dataset.deviceState)"
    )
    assert states and set(states) == {"quarantined"}
    await screenshot(page, "fleet-quarantined")
    await page.click(f"[data-node='{victim}'] a")
    await expect(page.locator("[data-testid=node-state]")).to_have_text("quarantined")
    await expect(page.locator("[data-testid=health]")).to_contain_text("unhealthy")
    await screenshot(page, "node-quarantined")
    assert troubles.seen == []
    await context.close()
