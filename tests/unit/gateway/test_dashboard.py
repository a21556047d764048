"""The dashboard's pure parts: sessions and CSRF, URL state parsing (hostile input included),
page cursors, reading services' metrics, and the numbers people read."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request

from services.common import scrape
from services.gateway.auth import Principal, Role
from services.gateway.dashboard.queries import (
    BadQuery,
    JobQuery,
    decode_cursor,
    encode_cursor,
)
from services.gateway.dashboard.render import duration, money, number
from services.gateway.dashboard.session import COOKIE, Sessions
from services.gateway.dashboard.views import _safe_next

TOKENS = {
    "tok-vision": Principal("vision", Role.USER),
    "tok-admin": Principal("platform", Role.ADMIN),
}
VENDOR = Path(__file__).resolve().parents[3] / "services/gateway/dashboard/static/vendor"


def request(headers: dict[str, str] | None = None, cookie: str | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if cookie is not None:
        raw.append((b"cookie", f"{COOKIE}={cookie}".encode()))
    return Request({"type": "http", "method": "GET", "path": "/ui/", "headers": raw})


# --- sessions ------------------------------------------------------------------------------


def test_a_session_names_its_token_and_ends_when_it_expires() -> None:
    sessions = Sessions(TOKENS, "secret", hours=1)
    cookie = sessions.issue("tok-vision", now=1000.0)
    assert cookie is not None and "tok-vision" not in cookie  # no token in the cookie
    assert sessions.read(cookie, now=1000.0 + 3599) == TOKENS["tok-vision"]
    assert sessions.read(cookie, now=1000.0 + 3601) is None
    assert sessions.issue("not-a-token") is None


def test_a_tampered_or_foreign_cookie_is_nobody() -> None:
    sessions = Sessions(TOKENS, "secret", hours=1)
    cookie = sessions.issue("tok-vision", now=1000.0)
    assert cookie is not None
    digest, expires, signature = cookie.split(".")
    later = f"{digest}.{int(expires) + 10**6}.{signature}"
    assert sessions.read(later, now=1000.0) is None  # expiry pushed out: signature breaks
    admin = Sessions(TOKENS, "secret", 1).issue("tok-admin", now=1000.0)
    assert admin is not None
    forged = f"{admin.split('.')[0]}.{expires}.{signature}"
    assert sessions.read(forged, now=1000.0) is None  # another token's digest
    other_key = Sessions(TOKENS, "another secret", hours=1)
    assert other_key.read(cookie, now=1000.0) is None
    hostile = ("\x00.\x00.\x00", "a.99999999999999999999.b", "a." + "9" * 5000 + ".b")
    for junk in ("", ".", "..", "a.b.c", "x" * 5000, *hostile, "a.\u0663\u0663.b", "a.1.\xe9\xff"):
        assert sessions.read(junk, now=1000.0) is None


def test_a_token_taken_out_of_the_auth_file_ends_its_sessions() -> None:
    cookie = Sessions(TOKENS, "secret", 1).issue("tok-vision", now=1000.0)
    assert cookie is not None
    without = Sessions({"tok-admin": TOKENS["tok-admin"]}, "secret", 1)
    assert without.read(cookie, now=1000.0) is None


def test_the_viewer_comes_from_the_bearer_header_first_then_the_cookie() -> None:
    sessions = Sessions(TOKENS, "secret", hours=1)
    cookie = sessions.issue("tok-vision")
    assert cookie is not None
    seen = sessions.viewer(request(cookie=cookie))
    assert seen is not None and seen.tenant == "vision" and seen.session == cookie
    assert seen.csrf == sessions.csrf_for(cookie) and len(seen.csrf) == 32
    bearer = sessions.viewer(request({"Authorization": "Bearer tok-admin"}, cookie=cookie))
    assert bearer is not None and bearer.tenant == "platform" and bearer.session is None
    assert sessions.viewer(request()) is None
    assert sessions.viewer(request(cookie="garbage")) is None


def test_a_change_with_a_cookie_needs_the_csrf_token() -> None:
    from fastapi import HTTPException

    sessions = Sessions(TOKENS, "secret", hours=1)
    cookie = sessions.issue("tok-vision")
    assert cookie is not None
    seen = sessions.viewer(request(cookie=cookie))
    assert seen is not None
    with pytest.raises(HTTPException) as refused:
        sessions.check_csrf(request(cookie=cookie), seen)
    assert refused.value.status_code == 403
    with pytest.raises(HTTPException):
        sessions.check_csrf(request({"X-QM-CSRF": "0" * 32}, cookie=cookie), seen)
    sessions.check_csrf(request({"X-QM-CSRF": seen.csrf}, cookie=cookie), seen)
    sessions.check_csrf(request(cookie=cookie), seen, form_value=seen.csrf)
    bearer = sessions.viewer(request({"Authorization": "Bearer tok-vision"}))
    assert bearer is not None
    sessions.check_csrf(request({"Authorization": "Bearer tok-vision"}), bearer)


def test_after_signing_in_only_a_page_of_the_dashboard_is_a_destination() -> None:
    assert _safe_next("/ui/jobs?state=queued") == "/ui/jobs?state=queued"
    for hostile in ("https://evil.example/", "//evil.example/ui", "/v1/jobs", "", None, "ui"):
        assert _safe_next(hostile) == "/ui/"


# --- URL state -----------------------------------------------------------------------------


def test_filters_groups_and_sorts_come_from_the_url() -> None:
    q = JobQuery.parse(
        {"tenant": "vision,nlp", "state": "pending,failed", "group": "queue", "limit": "25"},
        scope_tenant=None,
    )
    assert q.filters["tenant"] == ("vision", "nlp")
    assert q.filters["state"] == ("submitted", "queued", "failed")
    assert (q.group, q.limit, q.sort) == ("queue", 25, "newest")
    back = q.params()
    assert back["state"] == "submitted,queued,failed" and "sort" not in back
    assert JobQuery.parse(back, scope_tenant=None).filters == q.filters


def test_a_tenant_scoped_viewer_is_held_to_their_tenant() -> None:
    q = JobQuery.parse({}, scope_tenant="vision")
    assert q.filters["tenant"] == ("vision",)
    assert JobQuery.parse({"tenant": "vision"}, scope_tenant="vision").filters["tenant"] == (
        "vision",
    )
    for asked in ("nlp", "vision,nlp"):
        with pytest.raises(BadQuery, match="may only see tenant 'vision'"):
            JobQuery.parse({"tenant": asked}, scope_tenant="vision")


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"state": "exploded"}, "unknown state 'exploded'"),
        ({"group": "job_id; DROP TABLE jobs"}, "cannot group by"),
        ({"sort": "random()"}, "sort must be one of"),
        ({"limit": "1000000"}, "limit must be one of"),
        ({"limit": "NaN"}, "limit must be"),
        ({"after": "%%%"}, "damaged"),
        ({"before": "bm90LWEtY3Vyc29y"}, "damaged"),  # base64 of "not-a-cursor"
    ],
)
def test_a_bad_url_is_refused_with_what_is_wrong(params: dict[str, str], words: str) -> None:
    with pytest.raises(BadQuery, match=words):
        JobQuery.parse(params, scope_tenant=None)


@given(
    st.datetimes(timezones=st.just(UTC)),
    st.text(min_size=1, max_size=60).filter(lambda s: "\x00" not in s),
)
def test_a_cursor_round_trips(at: datetime, job_id: str) -> None:
    assert decode_cursor(encode_cursor(at, job_id)) == (at, job_id)


@given(st.text(max_size=80))
def test_no_text_breaks_the_cursor_reader_but_with_badquery(raw: str) -> None:
    try:
        at, job_id = decode_cursor(raw)
    except BadQuery:
        return
    assert at.tzinfo is not None and job_id


# --- metrics of other services ------------------------------------------------------------


METRICS = """# HELP qm_scheduler_cycle_seconds One decide cycle
# TYPE qm_scheduler_cycle_seconds histogram
qm_scheduler_cycle_seconds_bucket{le="0.005"} 50.0
qm_scheduler_cycle_seconds_bucket{le="0.01"} 90.0
qm_scheduler_cycle_seconds_bucket{le="0.1"} 100.0
qm_scheduler_cycle_seconds_bucket{le="+Inf"} 100.0
qm_scheduler_cycle_seconds_count 100.0
qm_scheduler_cycle_seconds_sum 0.6
# TYPE qm_scheduler_is_leader gauge
qm_scheduler_is_leader 1.0
# TYPE qm_consumer_dead_letters_total counter
qm_consumer_dead_letters_total{group="queue"} 3.0
qm_consumer_dead_letters_total{group="queue-lifecycle"} 1.0
"""


def test_a_services_metrics_are_read_into_figures() -> None:
    target = scrape.Target("scheduler", "http://x/metrics", scrape.parse_metrics(METRICS))
    assert target.total("qm_scheduler_is_leader") == 1.0
    assert target.total("qm_consumer_dead_letters_total") == 4.0
    assert target.total("qm_consumer_dead_letters_total", group="queue") == 3.0
    h = scrape.histogram(target, "qm_scheduler_cycle_seconds")
    assert h["count"] == 100 and h["mean"] == pytest.approx(0.006)
    assert h["p50"] == pytest.approx(0.005)  # exactly at the first bucket's edge
    assert h["p99"] == pytest.approx(0.01 + 0.09 * 0.9)


def test_quantiles_of_empty_or_odd_histograms() -> None:
    assert scrape.histogram_quantile(0.5, []) is None
    assert scrape.histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    # everything above the last finite bucket: the best answer is that bucket's edge
    assert scrape.histogram_quantile(0.99, [(1.0, 0.0), (math.inf, 10.0)]) == 1.0


def test_targets_are_named_urls() -> None:
    assert scrape.parse_targets(" queue=http://a/metrics, http://b/metrics ,,") == [
        ("queue", "http://a/metrics"),
        ("http://b/metrics", "http://b/metrics"),
    ]


async def test_an_unreachable_service_is_reported_not_raised() -> None:
    (target,) = await scrape.scrape([("gone", "http://127.0.0.1:9/metrics")])
    assert target.error is not None and target.samples == []


# --- numbers people read -------------------------------------------------------------------


def test_numbers_read_as_people_write_them() -> None:
    assert duration(4.25) == "4.2 s" and duration(42) == "42 s"
    assert duration(3 * 3600 + 5 * 60) == "3 h 5 min" and duration(90_000) == "1 d 1 h"
    assert duration(None) == "" and duration(float("nan")) == ""
    assert money(1234.5, "USD") == "1,234.50 USD" and money(None) == ""
    assert number(8.0) == "8" and number(0.5, 2) == "0.50" and number(float("inf")) == ""


def test_the_vendored_scripts_are_the_published_ones() -> None:
    table = (VENDOR / "README.md").read_text()
    files = sorted(p for p in VENDOR.iterdir() if p.suffix in (".js", ".css"))
    assert len(files) == 4
    for path in files:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"| {path.name} |" in table and digest in table, path.name


# --- live updates --------------------------------------------------------------------------


def test_change_messages_are_read_defensively_and_scoped_to_a_tenant() -> None:
    from services.gateway.dashboard.live import _changed_jobs

    batch = [
        '[["a", "vision", "running"], ["b", "nlp", "queued"]]',
        "not json",
        b"\xff\xfe",
        '{"a": 1}',
        '[["too", "short"], 7, null, ["c", "vision", "succeeded"]]',
    ]
    assert _changed_jobs(batch, None) == {"a": "running", "b": "queued", "c": "succeeded"}
    assert _changed_jobs(batch, "vision") == {"a": "running", "c": "succeeded"}
    assert _changed_jobs(batch, "speech") == {}


async def test_the_hub_fans_out_and_a_slow_page_loses_only_its_oldest() -> None:
    from services.gateway.dashboard.live import QUEUE_LIMIT, ChangeHub

    class NoRedis:
        def pubsub(self) -> None:
            raise OSError("no Redis in a unit test")

    hub = ChangeHub(NoRedis())  # type: ignore[arg-type]
    with hub.listen() as fast, hub.listen() as slow:
        for i in range(QUEUE_LIMIT + 5):
            hub.deliver(str(i))
            if i < 3:
                assert fast.get_nowait() == str(i)
        assert slow.qsize() == QUEUE_LIMIT and slow.get_nowait() == "5"
        assert hub.dropped == 5 + 2  # fast fell behind too, after it stopped reading
    assert hub.queues == set()
    assert hub.task is not None
    hub.task.cancel()


def test_csv_cells_never_start_a_formula() -> None:
    from services.gateway.dashboard.views import csv_cell

    assert csv_cell('=HYPERLINK("http://evil")') == '\'=HYPERLINK("http://evil")'
    for text in ("+1", "-2", "@SUM(A1)", "\tx", "\rx"):
        assert str(csv_cell(text)).startswith("'")
    assert csv_cell("train-8xh100") == "train-8xh100"
    assert csv_cell(-2.5) == -2.5 and csv_cell(None) == ""


async def _serve(handler: Any) -> tuple[Any, str]:
    import asyncio

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/metrics"


async def test_a_trickling_or_huge_metrics_page_is_cut_off() -> None:
    import asyncio

    async def trickle(reader: Any, writer: Any) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            while True:  # a byte now and then, forever: no read ever times out
                writer.write(b"#")
                await writer.drain()
                await asyncio.sleep(0.2)

    async def huge(reader: Any, writer: Any) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n")
        line = b"qm_x_total 1\n" * 10_000
        with contextlib.suppress(ConnectionError):
            for _ in range(100):  # 13 MB
                writer.write(line)
                await writer.drain()

    slow, slow_url = await _serve(trickle)
    big, big_url = await _serve(huge)
    try:
        slow_t, big_t = await scrape.scrape([("slow", slow_url), ("big", big_url)])
    finally:
        for s in (slow, big):
            s.close()
    assert slow_t.error is not None and "no answer within" in slow_t.error
    assert big_t.error is not None and "TooLarge" in big_t.error
    assert slow_t.samples == [] and big_t.samples == []


async def test_a_kept_client_scrapes_again_over_the_same_connection() -> None:
    """The health service scrapes every SLO evaluation with one kept client
    (scrape.scrape_client): no new TLS context or connection per scrape."""
    connections = 0

    async def metrics(reader: Any, writer: Any) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:  # keep-alive: answer every request on this connection
                await reader.readuntil(b"\r\n\r\n")
                body = b"qm_x_total 3\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                    + b"content-length: %d\r\n\r\n" % len(body)
                    + body
                )
                await writer.drain()

    server, url = await _serve(metrics)
    client = scrape.scrape_client()
    try:
        for _ in range(3):
            (target,) = await scrape.scrape([("queue", url)], client)
            assert target.error is None and target.total("qm_x_total") == 3
        assert not client.is_closed  # the caller's to close
    finally:
        await client.aclose()
        server.close()
    assert connections == 1


def test_odd_histogram_samples_are_left_out() -> None:
    text = (
        "# TYPE h histogram\n"
        'h_bucket{le="0.1"} 5\n'
        'h_bucket{le="abc"} 7\n'
        'h_bucket{le="NaN"} 7\n'
        'h_bucket{le="+Inf"} 10\n'
        "h_count 10\nh_sum 2\n"
    )
    samples = scrape.parse_metrics(text)
    h = scrape.histogram(scrape.Target("t", "u", samples), "h")
    assert h["count"] == 10 and h["p50"] == pytest.approx(0.1)
