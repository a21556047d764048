"""A scheduler snapshot restores the state it was taken of: after any sequence of events and
cycles (the same driver as the working-set property), `restore(capture(state))` holds what the
state held, field by field, and a scheduler deciding on it decides the same."""

from __future__ import annotations

import asyncio
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.scheduler.snapshot import (
    FINISHED_IN_SNAPSHOT,
    capture,
    capture_in_slices,
    decode,
    restore,
)
from services.scheduler.state import SchedulerState
from tests.unit.services.test_scheduler_working_set import STEP, World, play

MARKS = {("job.queued", 0): (12, 1_700_000_000_000, 321), ("job.finished", 3): (4, 17, 99)}
# Bookkeeping of the process, not of the log: not in a snapshot.
LOCAL = {"touched", "dirty", "fleet_version", "own"}


def restored(state: SchedulerState) -> SchedulerState:
    fresh = SchedulerState(time_scale=state.time_scale)
    marks = restore(fresh, decode(capture(state, MARKS)))
    assert marks == MARKS
    return fresh


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, min_size=5, max_size=60), lose=st.lists(st.booleans(), max_size=4))
def test_a_snapshot_restores_every_field(steps: list[tuple[Any, ...]], lose: list[bool]) -> None:
    world = World(lose)
    play(world, steps)
    # Encoded a few jobs at a time with the loop running between, the same bytes.
    whole = capture(world.state, MARKS)
    assert asyncio.run(capture_in_slices(world.state, MARKS, slice_jobs=3)) == whole
    back = restored(world.state)
    for f in fields(SchedulerState):
        if f.name not in LOCAL:
            assert getattr(back, f.name) == getattr(world.state, f.name), f.name
    # And the next decisions are the same as the original state's.
    twin = World(lose=[])
    twin.state = back
    twin.cycle.state = back
    twin.now = world.now
    # The fair-share usage the leader accrues is its cycle's own, not the state's (a new
    # leader starts it afresh): given the same, the restored state decides the same.
    twin.cycle.usage = dict(world.cycle.usage)
    twin.cycle.last_accrual = world.cycle.last_accrual
    mine = world.cycle.decide(epoch=2, now=world.now + 1)
    theirs = twin.cycle.decide(epoch=2, now=world.now + 1)
    assert [e for _, e in mine.placements] == [e for _, e in theirs.placements]


def test_only_the_newest_finished_ids_are_kept() -> None:
    state = SchedulerState()
    for i in range(FINISHED_IN_SNAPSHOT + 10):
        state.finished[f"done-{i}"] = None  # type: ignore[index]
    back = restored(state)
    assert len(back.finished) == FINISHED_IN_SNAPSHOT
    assert next(iter(back.finished)) == "done-10"


def test_a_snapshot_of_another_format_or_scale_is_refused() -> None:
    body = capture(SchedulerState(time_scale=600.0), MARKS)
    with pytest.raises(ValidationError):
        decode(body.replace(b'"format":1', b'"format":2'))
    with pytest.raises(ValidationError):
        decode(b"not json")
    with pytest.raises(ValueError, match="time scale"):
        restore(SchedulerState(time_scale=1.0), decode(body))


def test_a_placement_read_before_its_job_keeps_its_head_through_a_snapshot() -> None:
    """An early placement is kept as read, without its spec's body; one kept whole (a leader's
    own, or a snapshot written before) is written whole and read back as its head."""
    from schemas.events import PlacementHead
    from tests.unit.services.test_scheduler_state import placed, queued

    whole = placed("j1")
    state = SchedulerState()
    state.on_placed(PlacementHead.model_validate(whole.model_dump()), 1.0)
    state.on_placed(placed("j2"), 2.0)
    body = capture(state, MARKS)
    assert b'"resources"' in body  # j2's, written whole
    back = restored(state)
    assert set(back.early) == {"j1", "j2"}
    for job_id in ("j1", "j2"):
        ((read, _),) = back.early[job_id]  # type: ignore[index]
        assert type(read) is PlacementHead and read.spec.tenant == whole.spec.tenant
        back.on_queued(queued(job_id))
    assert sorted(back.running) == ["j1", "j2"]
    assert back.running["j2"].start_time == 2.0  # type: ignore[index]
