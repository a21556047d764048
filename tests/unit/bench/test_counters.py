"""The e2e bench's counts per job: read from the consumers' own metrics (by their real names,
so a renamed metric fails here, not silently as an empty table) and divided by a phase's jobs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from bench.counters import Reading, group_counts, per_job
from services.common.consumer import ConsumerMetrics


def test_batches_and_records_per_group_from_a_services_page() -> None:
    registry = CollectorRegistry()
    metrics = ConsumerMetrics(registry)
    for took in (0.01, 0.02, 0.03):
        metrics.batch.labels("queue").observe(took)
    metrics.records.labels("queue").inc(30)
    metrics.batch.labels("queue-lifecycle").observe(0.1)
    metrics.records.labels("queue-lifecycle").inc(5)
    metrics.dead_letters.labels("queue").inc(2)  # other families of the group are not counted
    metrics.requests.labels("queue", "Fetch").inc(7)
    metrics.requests.labels("queue", "Heartbeat").inc(4)
    metrics.requests.labels("queue", "OffsetCommit").inc(2)

    counts = group_counts(generate_latest(registry).decode())

    # batches, records, fetches, requests of any kind
    assert counts == {"queue": (3.0, 30.0, 7.0, 13.0), "queue-lifecycle": (1.0, 5.0, 0.0, 0.0)}


ANSWERED = frozenset({"queue", "meter", "gateway"})


def test_per_job_is_the_phases_difference_divided_by_its_jobs() -> None:
    before = Reading(
        pg={"xact_commit": 100.0, "tup_inserted": 1000.0, "tup_updated": 10.0, "tup_deleted": 0.0},
        groups={
            ("queue", "queue"): (10.0, 100.0, 20.0, 30.0),
            ("meter", "meter"): (5.0, 50.0, 9.0, 9.0),
        },
        tables={"queue.history": 500.0, "meter.runs": 70.0, "gateway.jobs": 10.0},
        answered=ANSWERED,
    )
    after = Reading(
        pg={
            "xact_commit": 150.0,
            "tup_inserted": 3000.0,
            "tup_updated": 210.0,
            "tup_deleted": 100.0,
        },
        groups={
            ("queue", "queue"): (60.0, 1100.0, 120.0, 150.0),
            # no batch in the phase: left out of the groups, its polls counted in all
            ("meter", "meter"): (5.0, 50.0, 19.0, 19.0),
            ("gateway", "gateway"): (4.0, 400.0, 8.0, 10.0),  # first seen after: from zero
        },
        tables={
            "queue.history": 900.0,
            "meter.runs": 70.0,  # not written in the phase: left out
            "gateway.jobs": 310.0,
            "queue.outbox": 50.0,  # first seen after
        },
        answered=ANSWERED,
    )

    got = per_job(before, after, jobs=100, seconds=10.0)

    assert got["pg"] == {
        "xact_commit": 0.5,
        "tup_inserted": 20.0,
        "tup_updated": 2.0,
        "tup_deleted": 1.0,
        "row_writes": 23.0,
    }
    assert got["groups"] == {
        "gateway/gateway": {
            "batches_per_job": 0.04,
            "batches_per_s": 0.4,
            "records_per_batch": 100.0,
            "fetches_per_batch": 2.0,
        },
        "queue/queue": {
            "batches_per_job": 0.5,
            "batches_per_s": 5.0,
            "records_per_batch": 20.0,
            "fetches_per_batch": 2.0,
        },
    }
    assert got["batches_per_job"] == 0.54
    assert got["consumer_requests_per_job"] == 1.4  # (120 + 10 + 10) / 100
    # most written first
    assert list(got["tables"].items()) == [
        ("queue.history", 4.0),
        ("gateway.jobs", 3.0),
        ("queue.outbox", 0.5),
    ]


def test_only_what_both_readings_have_is_counted() -> None:
    """A service that did not answer before the phase, PostgreSQL unread before it, or a
    service whose counters went back (it restarted) would be charged what it counted since it
    started: each is left out, and a restart is named."""
    before = Reading(
        pg={},  # PostgreSQL could not be read
        groups={("queue", "queue"): (50.0, 500.0, 60.0, 80.0)},
        tables={},
        answered=frozenset({"queue"}),  # the gateway did not answer
    )
    after = Reading(
        pg={"xact_commit": 900.0},
        groups={
            ("queue", "queue"): (5.0, 40.0, 6.0, 9.0),  # restarted in the phase
            ("gateway", "gateway"): (400.0, 4000.0, 800.0, 900.0),
        },
        tables={"queue.history": 9000.0},
        answered=frozenset({"queue", "gateway"}),
    )

    got = per_job(before, after, jobs=10, seconds=1.0)

    assert got["pg"] == {} and got["tables"] == {}
    assert got["groups"] == {}
    assert got["consumer_requests_per_job"] == 0.0
    assert got["restarted"] == ["queue/queue"]


def test_no_jobs_no_figures() -> None:
    empty = Reading(pg={}, groups={})
    assert per_job(empty, empty, jobs=0, seconds=1.0) == {}
