"""Runs as the meter sees them, folded from lifecycle facts, and the ticks each step produces.
Pure apart from the price book, which an executor's inventory may teach new prices.

A run (job id + attempt) opens when both its placement (who, what, which nodes and tiers) and
its start (when) are known -- they travel on different topics and may arrive in either order
-- and closes on its end (how long it ran, as the executor measured it). A JobFinished from
anyone but an executor that says the run lasted 0 s is the queue's bookkeeping for a job that
never ran; it closes nothing, so a race between a cancel and a start cannot erase a real run.
A `job.preempted` (node failure, room for a higher claim) or a `job.run.failed` (the job's own
failure, retried or not) closes a run the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from schemas.events import ClusterCapacity, ReplicaAssignment
from services.common.frozen import evolve
from services.meter.pricing import Pool, PriceBook
from services.meter.ticks import Grid, Run, Share, Tick, bill_through, close_run

RunKey = tuple[str, int]  # job id, attempt


class Phase(StrEnum):
    PENDING = "pending"  # placement or start still missing
    OPEN = "open"  # billed by the clock until it closes
    CLOSED = "closed"


# --- facts: the one conversion point from wire payloads is services.meter.intake ---------


@dataclass(frozen=True)
class Placed:
    job_id: str
    attempt: int
    epoch: int
    tenant: str
    project: str
    user: str
    cluster: str
    accelerator_type: str
    replicas: tuple[ReplicaAssignment, ...]


@dataclass(frozen=True)
class Refused:
    job_id: str
    attempt: int
    epoch: int


@dataclass(frozen=True)
class Started:
    job_id: str
    attempt: int
    nodes: tuple[str, ...]
    started_at: datetime


@dataclass(frozen=True)
class Finished:
    job_id: str
    attempt: int
    ran_u: int  # fleet microseconds it ran
    outcome: str
    measured: bool  # by an executor (or anyone reporting a run time): it may close a run


@dataclass(frozen=True)
class Capacity:
    capacity: ClusterCapacity


Fact = Placed | Refused | Started | Finished | Capacity


# --- state -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    epoch: int
    tenant: str
    project: str
    user: str
    cluster: str
    accelerator_type: str
    nodes: tuple[str, ...]
    shares: tuple[Share, ...]


@dataclass(frozen=True)
class RunState:
    job_id: str
    attempt: int
    phase: Phase = Phase.PENDING
    placements: tuple[Placement, ...] = ()
    started_at: datetime | None = None
    nodes: tuple[str, ...] = ()
    ran_u: int | None = None
    outcome: str | None = None
    run: Run | None = None
    cut: bool = False  # closed short of the run time reported (advance)

    @property
    def key(self) -> RunKey:
        return (self.job_id, self.attempt)


@dataclass
class Applied:
    """What a batch of facts changed."""

    states: dict[RunKey, RunState] = field(default_factory=dict)
    ticks: list[Tick] = field(default_factory=list)
    pools: dict[str, list[Pool]] = field(default_factory=dict)  # cluster -> its inventory
    opened: int = 0
    closed: int = 0
    cut: int = 0  # runs closed at latest_end_v, short of the end their producer reported


def fact_key(fact: Fact) -> RunKey | None:
    return None if isinstance(fact, Capacity) else (fact.job_id, fact.attempt)


def apply_facts(
    facts: Iterable[Fact],
    known: dict[RunKey, RunState],
    book: PriceBook,
    grid: Grid,
    latest_end_v: int | None = None,
) -> Applied:
    """Fold facts, in order, into the known states of their runs (missing ones start empty).
    A run is closed no later than `latest_end_v` (fleet microseconds; see `advance`)."""
    out = Applied()
    for fact in facts:
        if isinstance(fact, Capacity):
            out.pools[fact.capacity.cluster] = book.learn(fact.capacity)
            continue
        key = (fact.job_id, fact.attempt)
        before = out.states.get(key) or known.get(key) or RunState(*key)
        state, ticks = advance(_take(before, fact, book), grid, latest_end_v)
        out.cut += int(state.cut and not before.cut)
        if state != before:
            out.states[key] = state
            out.opened += int(before.phase is Phase.PENDING and state.phase is not Phase.PENDING)
            out.closed += int(before.phase is not Phase.CLOSED and state.phase is Phase.CLOSED)
        out.ticks.extend(ticks)
    return out


def _take(st: RunState, fact: Fact, book: PriceBook) -> RunState:
    if isinstance(fact, Placed):
        if st.phase is not Phase.PENDING:
            return st
        placement = Placement(
            fact.epoch,
            fact.tenant,
            fact.project,
            fact.user,
            fact.cluster,
            fact.accelerator_type,
            tuple(sorted({r.node_id for r in fact.replicas})),
            book.shares(fact.cluster, fact.accelerator_type, list(fact.replicas)),
        )
        kept = tuple(p for p in st.placements if p.epoch != fact.epoch)
        return evolve(st, placements=(*kept, placement))
    if isinstance(fact, Refused):
        if st.phase is not Phase.PENDING:
            return st  # it started after all (or ended): a refusal of another epoch
        return evolve(st, placements=tuple(p for p in st.placements if p.epoch != fact.epoch))
    if isinstance(fact, Started):
        if st.started_at is not None:
            return st
        return evolve(st, started_at=fact.started_at, nodes=tuple(sorted(fact.nodes)))
    if isinstance(fact, Finished):
        if st.ran_u is not None or not fact.measured:
            return st
        return evolve(st, ran_u=fact.ran_u, outcome=fact.outcome)
    return st


def _placement_of(st: RunState) -> Placement | None:
    """The placement that ran: the one on the nodes it started on, else the newest epoch."""
    if not st.placements:
        return None
    for p in st.placements:
        if p.nodes == st.nodes:
            return p
    return max(st.placements, key=lambda p: p.epoch)


def advance(
    st: RunState, grid: Grid, latest_end_v: int | None = None
) -> tuple[RunState, list[Tick]]:
    """Open a run whose placement and start are known; close an open run whose end is.

    A run cannot have ended after `latest_end_v` (the meter's clock, with room for skew):
    a longer run time reported (a timestamp sent as a duration, a clock gone wrong) is cut
    there, so that closing it costs ticks up to now at most, not one per interval of years,
    all built at once. The run is marked `cut`."""
    if st.phase is Phase.PENDING and st.started_at is not None:
        p = _placement_of(st)
        if p is not None:
            run = Run(
                st.job_id,
                st.attempt,
                p.tenant,
                p.project,
                p.user,
                p.cluster,
                p.accelerator_type,
                p.shares,
                start_v=grid.virtual(st.started_at),
            )
            st = evolve(st, phase=Phase.OPEN, run=run, placements=(p,))
    if st.phase is Phase.OPEN and st.ran_u is not None and st.run is not None:
        ran_u, cut = st.ran_u, False
        if latest_end_v is not None and st.run.start_v + ran_u > latest_end_v:
            ran_u, cut = max(0, latest_end_v - st.run.start_v), True
        ticks = close_run(st.run, ran_u, grid, st.outcome)
        return evolve(st, phase=Phase.CLOSED, placements=(), ran_u=ran_u, cut=cut), ticks
    return st, []


def bill_open(
    states: Iterable[RunState], last_index: int, grid: Grid, max_intervals: int
) -> tuple[list[RunState], list[Tick], bool]:
    """Interval ticks of open runs through interval `last_index`, at most `max_intervals`
    intervals per run in one go (a meter catching up after downtime); the flag says whether
    some run was held back by that limit."""
    changed: list[RunState] = []
    ticks: list[Tick] = []
    held_back = False
    for st in states:
        if st.run is None or st.phase is not Phase.OPEN:
            continue
        first = grid.index(st.run.start_v + st.run.billed_u)
        through = min(last_index, first + max_intervals - 1)
        held_back |= through < last_index
        run, new = bill_through(st.run, through, grid)
        if new:
            changed.append(evolve(st, run=run))
            ticks.extend(new)
    return changed, ticks, held_back
