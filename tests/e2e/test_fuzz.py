"""The issue's fuzz at CI size: hostile records of every class on every partition of every
consumed topic, then valid traffic, against a stack of its own (bench/fuzz.py: the records
would disturb the shared `qm_stack`'s other tests). One run, audited by criterion; each
assertion names the records, classes, topics and services that failed.

Nothing here depends on timing: the fuzz waits for conditions (jobs ended, groups committed)
with generous limits and only then audits. QM_FUZZ_SEED / QM_FUZZ_JOBS change the run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from bench.fuzz import fuzz, report
from bench.fuzz_wire import HostileClass

JOBS = int(os.environ.get("QM_FUZZ_JOBS", "100"))


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    keep = tmp_path_factory.mktemp("fuzz")
    result = fuzz(
        seed=int(os.environ.get("QM_FUZZ_SEED", "11")),
        rounds=1,
        jobs=JOBS,
        rest_jobs=10,
        drain_s=180.0,
        keep=keep,
    )
    result["kept"] = str(keep)
    print(report(result))
    return result


def failed(figures: dict[str, Any], check: str) -> str:
    lines = "\n  ".join(figures["failures"][check])
    where = Path(figures["kept"])
    return (
        f"{len(figures['failures'][check])} failure(s):\n  {lines}\n"
        f"(service logs: {where / 'state' / 'logs'}; every failed record in full: "
        f"{where / 'fuzz-failures.json'})"
    )


def test_every_topic_class_and_partition_was_fuzzed(figures: dict[str, Any]) -> None:
    assert set(figures["by_class"]) == {c.value for c in HostileClass}
    empty = [c for c, row in figures["by_class"].items() if not row.get("sent")]
    assert empty == [], f"classes with no records: {empty}"
    assert figures["setup"]["topics"] >= 20, figures["setup"]


def test_every_valid_job_succeeds(figures: dict[str, Any]) -> None:
    # probes (one per partition), bare JobSpec JSON on every partition and jobs over REST
    assert figures["valid_jobs"] >= JOBS, figures["valid_jobs"]
    assert not figures["failures"]["valid_jobs"], failed(figures, "valid_jobs")


def test_every_hostile_record_gets_what_its_class_requires(figures: dict[str, Any]) -> None:
    """Refused records dead-lettered or rejected with a reason; submissions that may run ran
    once and ended; unknown types never queued (bench/fuzz.py's docstring has the table)."""
    assert not figures["failures"]["hostile"], failed(figures, "hostile")


def test_no_service_died_restarted_or_lost_a_loop(figures: dict[str, Any]) -> None:
    assert not figures["failures"]["services"], failed(figures, "services")


def test_no_consumer_group_is_left_behind(figures: dict[str, Any]) -> None:
    assert figures["groups"] >= 11, f"only {figures['groups']} consumer groups seen"
    assert not figures["failures"]["groups"], failed(figures, "groups")


def test_a_probe_on_every_partition_is_answered_after_the_hostile_records(
    figures: dict[str, Any],
) -> None:
    assert not figures["failures"]["probes"], failed(figures, "probes")
