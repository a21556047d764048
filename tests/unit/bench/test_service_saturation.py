"""The saturation bench's arithmetic: rates and CPU per message, the marks it reads to, what it
parses out of committed offsets, metrics, logs and /proc/stat, and the capacity sums."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from bench.service_saturation import (
    committed_offsets,
    core_share,
    cores_for,
    cpu_jiffies,
    cpu_ms_per_msg,
    executor_outcome,
    first_received_at,
    interpolate,
    jobs_per_s,
    log_event,
    log_time,
    median,
    msgs_per_job,
    others_share,
    per_second,
    reached,
    records_to_marks,
    redis_db,
    replicas_for,
    table,
    topic_counts,
)

MARKS = {("job.queued", 0): 10, ("job.queued", 1): 0, ("job.finished", 0): 5}


def test_rate_cpu_and_share() -> None:
    assert per_second(3000, 1.5) == 2000
    assert cpu_ms_per_msg(0.3, 3000) == pytest.approx(0.1)
    assert core_share(0.75, 1.0) == 0.75
    for nan in (per_second(0, 1.0), per_second(10, 0.0), cpu_ms_per_msg(1.0, 0)):
        assert math.isnan(nan)
    assert math.isnan(core_share(1.0, 0.0))


def test_records_to_marks_counts_what_is_left_and_caps_at_the_mark() -> None:
    assert records_to_marks({}, MARKS) == 15
    assert records_to_marks({("job.queued", 0): 4}, MARKS) == 11
    # A commit past a mark (the last batch ran into later records) counts as the mark.
    assert records_to_marks({("job.queued", 0): 12, ("job.finished", 0): 5}, MARKS) == 0


def test_reached_needs_every_partition_and_empty_ones_are_reached() -> None:
    assert not reached({}, MARKS)
    assert not reached({("job.queued", 0): 10}, MARKS)
    assert reached({("job.queued", 0): 10, ("job.finished", 0): 7}, MARKS)
    assert reached({}, {("job.queued", 1): 0})


def test_committed_offsets_drops_partitions_without_a_commit() -> None:
    answer = {
        ("job.queued", 0): SimpleNamespace(offset=7, metadata=""),
        ("job.queued", 1): SimpleNamespace(offset=-1, metadata=""),
        ("job.finished", 0): 3,
    }
    assert committed_offsets(answer) == {("job.queued", 0): 7, ("job.finished", 0): 3}


def test_topic_counts_and_messages_per_job() -> None:
    counts = topic_counts(MARKS, {("job.queued", 0): 2})
    assert counts == {"job.queued": 8, "job.finished": 5}
    # A topic named twice in a service's inputs counts once.
    assert msgs_per_job(counts, ["job.queued", "job.finished", "job.queued"], 4) == 13 / 4
    assert msgs_per_job(counts, ["node.heartbeat"], 4) == 0
    assert math.isnan(msgs_per_job(counts, ["job.queued"], 0))


def test_capacity_sums() -> None:
    assert jobs_per_s(6000, 3.0) == 2000
    assert math.isnan(jobs_per_s(6000, 0.0))
    # 500 jobs/s at 4 messages each is 2,000 msgs/s; 1,000 msgs/s per instance at 70%: 3.
    assert replicas_for(500, 4.0, 1000) == 3
    assert replicas_for(500, 4.0, 1000, utilisation=1.0) == 2
    assert replicas_for(0, 4.0, 1000) == 0
    assert replicas_for(0.001, 4.0, 1000) == 1
    with pytest.raises(ValueError):
        replicas_for(10, 4.0, 0)
    assert cores_for(500, 4.0, 0.1) == pytest.approx(0.2)


def test_interpolate_between_samples_and_clamped_at_the_ends() -> None:
    points = [(10.0, 1.0), (11.0, 3.0), (13.0, 3.0)]
    assert interpolate(points, 10.5) == 2.0
    assert interpolate(points, 12.0) == 3.0
    assert interpolate(points, 9.0) == 1.0
    assert interpolate(points, 20.0) == 3.0
    assert math.isnan(interpolate([], 1.0))


def test_median_ignores_missing_figures() -> None:
    assert median([3.0, float("nan"), 1.0, 2.0]) == 2.0
    assert math.isnan(median([float("nan")]))


LABELS = 'app_name="executor/onprem-h100",broker="kafka",handler='
METRICS = f"""\
# HELP qm_received_messages_total Count of received messages by broker and handler
qm_received_messages_total{{{LABELS}"placement.decided"}} 2004.0
qm_received_messages_created{{{LABELS}"placement.decided"}} 1.7956205870316205e+09
qm_received_messages_created{{{LABELS}"node.unhealthy"}} 1.7956205857417533e+09
qm_executor_jobs_started_total 313.0
qm_executor_jobs_started_created 1.79562058e+09
qm_executor_placements_refused_total{{reason="would_overcommit"}} 567.0
qm_executor_placements_refused_total{{reason="stale_epoch"}} 0.0
"""


def test_first_batch_time_is_the_earliest_counter_creation() -> None:
    assert first_received_at(METRICS) == pytest.approx(1.7956205857417533e9)
    assert first_received_at("qm_other_created 1.0\n") is None


def test_executor_outcome_reads_starts_and_refusals() -> None:
    assert executor_outcome(METRICS) == "started 313 runs, refused 567 would_overcommit"
    assert executor_outcome("") == "started 0 runs, refused none"


def test_log_lines() -> None:
    line = (
        '{"records": 6011, "event": "snapshot caught up", "service": "scheduler", '
        '"level": "info", "timestamp": "2026-11-25T15:21:02.234593Z"}'
    )
    event = log_event(line)
    assert event is not None and event["records"] == 6011
    assert log_time(event) == pytest.approx(1795620062.234593)
    assert log_event("aiokafka.consumer some warning") is None
    assert log_event("{not json") is None
    assert log_event("[1, 2]") is None


STAT_BEFORE = "cpu  1 2 3 4\ncpu0 100 0 50 800 10 0 0 0 0 0\ncpu1 200 5 20 700 5 0 0 0 0 0\n"
STAT_AFTER = "cpu  1 2 3 4\ncpu0 100 0 50 900 10 0 0 0 0 0\ncpu1 260 5 40 720 5 0 0 0 0 0\n"


def test_core_jiffies_and_the_share_others_used() -> None:
    before, after = cpu_jiffies(STAT_BEFORE, 1), cpu_jiffies(STAT_AFTER, 1)
    assert before == (225, 930) and after == (305, 1030)
    assert cpu_jiffies(STAT_BEFORE, 2) is None
    # 100 jiffies (1 s at 100 Hz), 80 busy, of which the service used 0.5 s: others 0.3.
    assert others_share(before, after, 0.5, 100) == pytest.approx(0.3)
    assert others_share(before, after, 2.0, 100) == 0.0
    assert math.isnan(others_share(None, after, 0.0, 100))


def test_redis_db_index() -> None:
    assert redis_db("redis://127.0.0.1:6379/0", 3) == "redis://127.0.0.1:6379/3"
    assert redis_db("redis://127.0.0.1:6379", 2) == "redis://127.0.0.1:6379/2"


def test_table_aligns_columns() -> None:
    text = table([["service", "topics", "msgs/s"], ["queue", "2: a, b", "1,234"]])
    lines = text.splitlines()
    assert lines[0].startswith("service") and set(lines[1]) <= {"-", " "}
    assert lines[2].endswith("1,234") and len(lines[2]) == len(lines[0])
