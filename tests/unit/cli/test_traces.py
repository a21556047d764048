"""`qm trace`: a job's spans found in the stack's files (half-written lines and other jobs
ignored) and drawn as a tree with each hop's duration and the waits between hops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from cli.main import app
from cli.traces import read_spans, render, traces_of

MS = 1_000_000
T0 = 1_800_000_000_000_000_000
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def span(
    name: str,
    service: str,
    span_id: str,
    parent: str | None,
    start_ms: float,
    end_ms: float,
    trace: str = TRACE,
    job: str = "job-1",
    **extra: Any,
) -> dict[str, Any]:
    return {
        "trace_id": trace,
        "span_id": span_id,
        "parent_id": parent,
        "name": name,
        "service": service,
        "start_ns": T0 + int(start_ms * MS),
        "end_ns": T0 + int(end_ms * MS),
        "status": "unset",
        "attributes": {"qm.job_id": job},
        **extra,
    }


def one_job() -> list[dict[str, Any]]:
    return [
        span("gateway.submit", "gateway", "a" * 16, None, 0, 3),
        span(
            "queue.admit",
            "queue",
            "b" * 16,
            "a" * 16,
            15,
            23,
            attributes={"qm.job_id": "job-1", "qm.emitted": ["JobQueued"]},
        ),
        span(
            "scheduler.place",
            "scheduler",
            "c" * 16,
            "b" * 16,
            30,
            39_840,
            events=[{"name": "cycle.start", "time_ns": T0 + 39_830 * MS, "attributes": {}}],
        ),
        span("executor.start", "executor", "d" * 16, "c" * 16, 39_850, 39_870, instance="a"),
    ]


def write(directory: Path, name: str, records: list[dict[str, Any]], tail: bytes = b"") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    body = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    (directory / name).write_bytes(body + tail)


def test_the_spans_of_a_job_are_found_across_files_and_junk_is_skipped(tmp_path: Path) -> None:
    records = one_job()
    other = span("queue.admit", "queue", "e" * 16, None, 0, 1, trace="f" * 32, job="job-2")
    write(tmp_path, "gateway.1.jsonl", [*records[:1], other], tail=b'{"trace_id": "half a li')
    write(tmp_path, "queue.2.jsonl.1", [*records[1:2], {"not": "a span"}])
    write(tmp_path, "rest.3.jsonl", records[2:], tail=b"\xff\xfe\n[1, 2]\n")
    found = traces_of(read_spans(tmp_path), "job-1")
    assert list(found) == [TRACE]
    assert sorted(s.name for s in found[TRACE]) == [
        "executor.start",
        "gateway.submit",
        "queue.admit",
        "scheduler.place",
    ]
    assert list(traces_of(read_spans(tmp_path), "f" * 32)) == ["f" * 32]  # by trace id too


def test_a_trace_is_drawn_as_a_tree_with_waits_in_words(tmp_path: Path) -> None:
    write(tmp_path, "all.jsonl", one_job())
    lines = [line.plain for line in render(traces_of(read_spans(tmp_path), "job-1")[TRACE])]
    text = "\n".join(lines)
    assert "4 spans in 4 services (executor, gateway, queue, scheduler), 39.87 s end to end" in text
    body = lines[2:]
    assert "gateway.submit" in body[0] and "└" not in body[0]
    assert "  └ queue.admit" in body[1] and "12 ms after gateway.submit ended" in body[1]
    assert "emitted JobQueued" in body[1]
    assert "    └ scheduler.place" in body[2]
    assert "waited 39.80 s for the cycle that placed it" in body[2]
    assert "placed 10 ms after that cycle began" in body[2]
    assert "      └ executor.start (executor/a)" in body[3]
    assert body[3].lstrip().startswith("+39.85 s")


def test_a_span_whose_parent_is_missing_is_shown_as_a_root(tmp_path: Path) -> None:
    write(tmp_path, "part.jsonl", one_job()[2:])  # the gateway's and queue's not written yet
    lines = [line.plain for line in render(traces_of(read_spans(tmp_path), "job-1")[TRACE])]
    assert "its parent span is not in the files" in lines[2]
    assert "└ executor.start" in lines[3]


def test_a_failed_hop_says_why(tmp_path: Path) -> None:
    failed = span("scheduler.place", "scheduler", "c" * 16, None, 0, 5, status="error")
    failed["error"] = "not published"
    write(tmp_path, "f.jsonl", [failed])
    [line] = render(traces_of(read_spans(tmp_path), "job-1")[TRACE])[2:]
    assert "failed: not published" in line.plain
    assert any(span.style == "red" for span in line.spans)


def test_qm_trace_prints_the_tree_or_says_what_is_missing(tmp_path: Path) -> None:
    write(tmp_path, "all.jsonl", one_job())
    shown = CliRunner().invoke(app, ["trace", "job-1", "--dir", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    assert "scheduler.place" in shown.output and "waited 39.80 s" in shown.output
    as_json = CliRunner().invoke(app, ["trace", "job-1", "--dir", str(tmp_path), "--json"])
    assert [json.loads(line)["name"] for line in as_json.output.splitlines()] == [
        "gateway.submit",
        "queue.admit",
        "scheduler.place",
        "executor.start",
    ]
    missing = CliRunner().invoke(app, ["trace", "job-9", "--dir", str(tmp_path)])
    assert missing.exit_code == 1 and "no span of job-9" in missing.output
    nowhere = CliRunner().invoke(app, ["trace", "job-1", "--dir", str(tmp_path / "none")])
    assert nowhere.exit_code == 1 and "no traces at" in nowhere.output


def test_hostile_text_in_span_files_is_shown_as_text(tmp_path: Path) -> None:
    """Span files carry what was submitted (a job id, an error's words): markup is shown as
    it is, never applied (a `[/]` crashed rich before), and escape sequences never reach the
    terminal."""
    bad = span("[/]queue.admit", "[bold]queue", "d" * 16, None, 0, 5, job="j[/]")
    bad["status"] = "error"
    bad["error"] = "\x1b]0;owned\x07[red]boom\nforged row"
    write(tmp_path, "bad.jsonl", [bad])
    shown = CliRunner().invoke(app, ["trace", "j[/]", "--dir", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())  # as rich wrapped it at 80 columns
    assert "[/]queue.admit" in text and "([bold]queue)" in text
    assert "failed: ?]0;owned?[red]boom?forged row" in text
    assert "\x1b" not in shown.output and "\x07" not in shown.output
    missing = CliRunner().invoke(app, ["trace", "\x1b[2Jj[/x]", "--dir", str(tmp_path)])
    assert missing.exit_code == 1 and "no span of ?[2Jj[/x]" in missing.output
