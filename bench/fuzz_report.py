"""How a fuzz run reads to a person: failed records grouped by class and variant, every
failure in full for a kept run, and the printed summary."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from bench.fuzz_audit import Evidence, Verdict, dead_letter_consumers


def failure_lines(verdicts: list[Verdict], most: int = 80) -> list[str]:
    """Failed records grouped by class, variant and problem, each with the topics,
    partitions and offsets it happened at."""
    grouped: dict[tuple[str, str, str], list[Verdict]] = defaultdict(list)
    for v in verdicts:
        if not v.ok:
            grouped[(v.record.cls.value, v.record.variant, v.problem or "")].append(v)
    lines = []
    for (cls, variant, problem), vs in sorted(grouped.items()):
        where = ", ".join(f"{t}[{p}]@{o}" for t, p, o in sorted(v.coords for v in vs))
        lines.append(f"{cls}/{variant}: {problem}: {where}")
    return lines[:most] + ([f"... {len(lines) - most} more"] if len(lines) > most else [])


def failure_details(verdicts: list[Verdict], ev: Evidence) -> list[dict[str, Any]]:
    """Every failed record in full, for a kept run's `fuzz-failures.json`."""
    return [
        {
            "record": v.record.label(),
            "coords": v.coords,
            "problem": v.problem,
            "job_id": v.record.job_id,
            "job_end": ev.terminal(v.record.job_id) if v.record.job_id else None,
            "job_trail": ev.trail.get(v.record.job_id or "", [])[-12:],
            "dead_letters_by": dead_letter_consumers(ev, v.coords),
            "size": len(v.record.value or b""),
            "value_head": (v.record.value or b"")[:300].decode("utf-8", "backslashreplace"),
        }
        for v in verdicts
        if not v.ok
    ]


def report(figures: dict[str, Any]) -> str:
    lines = [
        f"{figures['records']} hostile records: {figures['dead_lettered']} dead-lettered, "
        f"{figures['rejected']} rejected, {figures['ignored']} ignored; "
        f"{figures['valid_succeeded']}/{figures['valid_jobs']} valid jobs succeeded; "
        f"{figures['unanswered']} unanswered or wrong",
        f"written in {figures['write_s']} s; all jobs ended {figures['terminal_s']} s and every "
        f"group caught up {figures['drain_s']} s after the first hostile record; slowest "
        f"probe answered in {figures['probe_answer_s_max']} s",
        f"groups {figures['groups']} ({figures['groups_behind']} behind); service deaths "
        f"{figures['service_deaths']}; loop crashes {figures['loop_crashes']}; records caught "
        f"by the pipeline's net {figures['net_catches']}; retries {figures['retries']}",
        f"{'class':<16}{'sent':>6}{'dead':>6}{'rej':>6}{'ans':>6}{'ign':>6}{'FAIL':>6}",
    ]
    for cls, row in figures["by_class"].items():
        lines.append(
            f"{cls:<16}{row.get('sent', 0):>6}{row.get('dead_lettered', 0):>6}"
            f"{row.get('rejected', 0):>6}{row.get('answered', 0):>6}{row.get('ignored', 0):>6}"
            f"{row.get('failed', 0):>6}"
        )
    for kind, items in figures["failures"].items():
        for item in items:
            lines.append(f"FAIL {kind}: {item}")
    return "\n".join(lines)
