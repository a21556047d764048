"""Repacking (core/repack.py): small running jobs move to room free elsewhere so that a job that
waited long for more of one node than any has free can start; never when a moved job would not
fit again, never a job the rules protect, and the same decisions on the simulator's fast path."""

from __future__ import annotations

from dataclasses import replace

import pytest

from core.cycle import decide
from core.model import Allocation, JobId, JobRequest
from core.policy import Policy
from core.reasons import ReasonCode
from core.state import CycleState
from tests.unit.core.builders import gpu_nodes, job, running, snapshot

REPACK = Policy.from_dict(
    {"preemption": {"repack": True, "repack_after_s": 1800, "min_runtime_s": 600}}
)
NOW = 10_000.0


def cycle(
    nodes: int, busy: list[Allocation], waiting: list[JobRequest], policy: Policy = REPACK
) -> tuple[list[tuple[str, list[tuple[str, ReasonCode]]]], list[str]]:
    state = CycleState.from_snapshot(snapshot(gpu_nodes(nodes), waiting, busy), policy)
    result = decide(state, policy, NOW)
    decisions = [
        (str(p.for_job), [(str(v.job_id), v.reason) for v in p.victims]) for p in result.preemptions
    ]
    return decisions, [str(a.job.job_id) for a in result.placements]


def test_a_small_job_moves_so_a_whole_node_job_can_start() -> None:
    busy = [
        running(job(4, job_id="a"), "c1-n-0000"),
        running(job(4, job_id="b"), "c1-n-0001"),
    ]
    waiting = [job(8, job_id="whole", submit=0)]
    decisions, placed = cycle(2, busy, waiting)
    assert placed == []
    assert decisions == [("whole", [("a", ReasonCode.REPACKED)])]
    # Off (the built-in default), or not waited long enough: nobody moves.
    assert cycle(2, busy, waiting, Policy.default())[0] == []
    assert cycle(2, busy, [job(8, job_id="fresh", submit=NOW - 60)])[0] == []


def test_nothing_moves_when_a_moved_job_would_not_fit_again() -> None:
    """Free: 4 on n0, 1 on n1, 3 on n2. Moving `a` (4) frees n0 but `a` fits nowhere then; the
    room on n1 is made by moving `c` (3, fits on n2) and `b` (4, fits on n0)."""
    busy = [
        running(job(4, job_id="a"), "c1-n-0000"),
        running(job(4, job_id="b"), "c1-n-0001"),
        running(job(3, job_id="c"), "c1-n-0001"),
        running(job(5, job_id="d"), "c1-n-0002"),
    ]
    decisions, _ = cycle(3, busy, [job(8, job_id="whole", submit=0)])
    assert decisions == [("whole", [("b", ReasonCode.REPACKED), ("c", ReasonCode.REPACKED)])]
    # Without n2's room for `c`, no set works.
    busy[3] = running(job(6, job_id="d"), "c1-n-0002")
    busy.append(running(job(1, job_id="e"), "c1-n-0000"))
    assert cycle(3, busy, [job(8, job_id="whole", submit=0)])[0] == []


@pytest.mark.parametrize(
    ("blocker", "start"),
    [
        (job(4, job_id="a", priority="high"), 0.0),  # outranks the waiting job
        (job(4, job_id="a", preemptible=False), 0.0),
        (job(4, job_id="a"), NOW - 60),  # started within min_runtime_s
    ],
    ids=["higher-rank", "not-preemptible", "too-young"],
)
def test_protected_jobs_never_move(blocker: JobRequest, start: float) -> None:
    twin = replace(blocker, job_id=JobId("b"))
    busy = [
        running(blocker, "c1-n-0000", start=start),
        running(twin, "c1-n-0001", start=start),
    ]
    assert cycle(2, busy, [job(8, job_id="whole", submit=0)])[0] == []


def test_only_jobs_smaller_than_a_replica_move_and_never_when_free_room_is_short() -> None:
    busy = [
        running(job(4, job_id="a"), "c1-n-0000"),
        running(job(6, job_id="b"), "c1-n-0001"),
    ]
    # 6 free in all: moving cannot make 8.
    assert cycle(2, busy, [job(8, job_id="whole", submit=0)])[0] == []
    # A 4-GPU job waits behind no fragmentation a move would fix (it is no bigger than a mover).
    busy = [running(job(5, job_id="a"), "c1-n-0000"), running(job(5, job_id="b"), "c1-n-0001")]
    assert cycle(2, busy, [job(4, job_id="four", submit=0)])[0] == []


def test_a_gang_gets_room_on_several_nodes() -> None:
    busy = [
        running(job(2, job_id="a"), "c1-n-0000"),
        running(job(2, job_id="b"), "c1-n-0001"),
        running(job(2, job_id="c"), "c1-n-0002"),
        running(job(2, job_id="d"), "c1-n-0003"),
    ]
    gang = job(8, replicas=2, job_id="gang", submit=0)
    decisions, _ = cycle(4, busy, [gang])
    assert len(decisions) == 1 and decisions[0][0] == "gang"
    assert len(decisions[0][1]) == 2
    assert {reason for _, reason in decisions[0][1]} == {ReasonCode.REPACKED}


def test_the_fast_path_repacks_alike() -> None:
    busy = [
        running(job(4, job_id="a"), "c1-n-0000"),
        running(job(4, job_id="b"), "c1-n-0001"),
    ]
    waiting = [job(8, job_id="whole", submit=0), job(8, job_id="whole2", submit=1)]
    explained = CycleState.from_snapshot(snapshot(gpu_nodes(2), waiting, busy), REPACK)
    fast = CycleState.from_snapshot(snapshot(gpu_nodes(2), waiting, busy), REPACK)
    a = decide(explained, REPACK, NOW)
    b = decide(fast, REPACK, NOW, explain_pending=False)
    assert a.preemptions == b.preemptions and a.placements == b.placements
    assert a.pending[JobId("whole")].codes[-1] is ReasonCode.AWAITING_PREEMPTION


def test_room_held_for_a_gang_or_a_strict_line_is_not_repacked_for() -> None:
    """A gang's reservation holds n0, n1 and n4 (the whole free node n4 among them): the job
    behind it misses on the hold, not on scattered room, and moving `a` would not let it
    start. Under strict FIFO only the head of the line may start, so only it is repacked for
    (the 16-GPU head cannot be: 8 are free)."""
    held = replace(REPACK, backfill=replace(REPACK.backfill, min_reserved_accelerators=16))
    busy = [
        running(job(4, job_id="a"), "c1-n-0000"),
        running(job(4, job_id="b"), "c1-n-0001"),
        running(job(8, job_id="c"), "c1-n-0002"),
        running(job(8, job_id="d"), "c1-n-0003"),
    ]
    waiting = [job(8, replicas=3, job_id="G", submit=0), job(8, job_id="T", submit=1)]
    assert cycle(5, busy, waiting, held)[0] == []
    fifo = Policy.from_dict(
        {"backfill": {"mode": "off"}, "preemption": {"repack": True, "repack_after_s": 1800}}
    )
    two = busy[:2]
    assert cycle(2, two, [job(8, job_id="whole", submit=0)], fifo)[0] == [
        ("whole", [("a", ReasonCode.REPACKED)])
    ]
    blocked = [job(8, replicas=2, job_id="head", submit=0), job(8, job_id="whole", submit=1)]
    assert cycle(2, two, blocked, fifo)[0] == []


def test_the_wait_counts_from_the_last_time_the_job_went_back_to_the_queue() -> None:
    busy = [
        running(job(4, job_id="a"), "c1-n-0000"),
        running(job(4, job_id="b"), "c1-n-0001"),
    ]
    requeued = replace(job(8, job_id="whole", submit=0), queued_time=NOW - 60)
    assert cycle(2, busy, [requeued])[0] == []
    waited = replace(requeued, queued_time=NOW - 3600)
    assert cycle(2, busy, [waited])[0] == [("whole", [("a", ReasonCode.REPACKED)])]
