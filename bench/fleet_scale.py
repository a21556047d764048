"""Benchmark: what one event costs the services that apply them as the fleet grows, where it
should cost what the event touches. In-process, no servers: each service's own handler code
runs on memory doubles of its outbox relay and store (what they write is not timed).

At clusters of `--sizes` nodes (8 devices each, `--runs-per-node` one-device runs on each):

- `executor_placement_us`: the executor takes a batch of one placement (its check against
  the nodes' books, the booking, the simulated start, the gauges);
- `executor_node_lost_us`: the executor takes a `node.unhealthy` (the node's gangs handed
  back);
- `meter_pass_us`: the meter's clock pass (four a second) between two interval closes, with
  as many open runs as the cluster holds;
- `health_batch_us`: the health service decides, applies and counts a batch of `--beats`
  heartbeats;
- `health_pass_us`: the health service's clock pass (once a second: silence, recovery, the
  straggler detector's expiry) over a healthy fleet in steady traffic: every node heartbeats
  every 5 s, a gang of four on every four nodes reports progress every 2 s; nothing to decide;
- `health_slow_report_us`: a progress report of a gang with a straggler on it while every
  other node of the cluster is out with an incident of its own (an outage);
- `health_recovery_ms`: the health service's clock pass in which a whole cluster that went
  dark comes back (once per size; a cluster incident closing with its last node).

Prints a table and ends with one JSON line (shared BENCH.md). Medians of `--rounds` rounds.

    python bench/fleet_scale.py [--sizes 100,1000,5000] [--runs-per-node 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import structlog
from aiokafka import ConsumerRecord
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe
from core.model import AcceleratorModel, ClusterId, Node, NodeId
from schemas import topics
from schemas.envelope import Envelope
from schemas.events import PlacementDecided, ReplicaAssignment
from schemas.health import NodeUnhealthy, Severity
from schemas.job import JobSpec
from services.executor.handlers import Executor
from services.executor.metrics import ExecutorMetrics
from services.executor.nodes import NodeBook
from services.executor.simulated import RunEnd
from services.executor.store import RunningJob
from services.health import store as health_store
from services.health.book import (
    Beat,
    Draft,
    HealthBook,
    Incident,
    check,
    heartbeats_seen,
    inventory_seen,
)
from services.health.handlers import HealthMetrics, HealthMonitor
from services.health.machine import NodeHealth, NodeState
from services.health.pace import Progress, ReplicaStep
from services.health.rules import STRAGGLER, HealthRules, Timings
from services.health.stragglers import expired, progress_seen
from services.meter import store as meter_store
from services.meter.budgets import MeterConfig
from services.meter.handlers import Meter, MeterMetrics
from services.meter.pricing import PriceBook
from services.meter.runs import Phase, RunState
from services.meter.ticks import Grid, Run, Share, micros

CLUSTER = "scale"
# The figures, each by cluster size (see the docstring).
FIGURES = (
    "executor_placement_us",
    "executor_node_lost_us",
    "meter_pass_us",
    "health_batch_us",
    "health_pass_us",
    "health_slow_report_us",
    "health_recovery_ms",
)
H100 = AcceleratorModel("H100", "hopper", 80, 3.0)
T0 = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)
SPEC = JobSpec.model_validate(
    {"tenant": "vision", "job_id": "x", "image": "trainer:1", "replicas": 1}
)


class _Tx:
    conn: Any = None

    async def claim(self, event_ids: list[str]) -> set[str]:
        return set(event_ids)

    def emit(self, _messages: Any) -> None:
        return None


class _Relay:
    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[_Tx]:
        yield _Tx()


class _ExecutorStore:
    def __init__(self, jobs: list[RunningJob]) -> None:
        self.jobs = jobs

    async def load(self) -> tuple[list[RunningJob], int, dict[str, float]]:
        return self.jobs, 0, {}

    async def write(self, *_args: Any, **_kwargs: Any) -> None:
        return None


async def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


_offsets = itertools.count()


def _record(topic: str, event_type: str, payload: Any, headers: tuple = ()) -> ConsumerRecord:
    value = Envelope(type=event_type, payload=payload.model_dump(mode="json")).model_dump_json()
    data = value.encode()
    return ConsumerRecord(topic, 0, next(_offsets), 0, 0, None, data, None, 0, len(data), headers)


def _node_id(i: int) -> str:
    return f"{CLUSTER}-n{i:05d}"


def _replica(node: int, replica: int = 0) -> ReplicaAssignment:
    return ReplicaAssignment(
        replica=replica, node_id=_node_id(node), accelerators=1, cpu=1, memory_gb=1
    )


def _median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def _timed(rounds: int, each: int, step: Callable[[int], Any]) -> float:
    """Median over rounds of the mean seconds per call of `step(i)` (synchronous)."""
    out, i = [], 0
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(each):
            step(i)
            i += 1
        out.append((time.perf_counter() - t) / each)
    return statistics.median(out)


async def _atimed(rounds: int, each: int, step: Callable[[int], Any]) -> float:
    out, i = [], 0
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(each):
            await step(i)
            i += 1
        out.append((time.perf_counter() - t) / each)
    return statistics.median(out)


async def executor_costs(nodes: int, per_node: int, rounds: int) -> tuple[float, float]:
    book = NodeBook(
        {
            _node_id(i): Node(
                NodeId(_node_id(i)),
                ClusterId(CLUSTER),
                "b",
                f"r{i // 8}",
                f"d{i}",
                H100,
                8,
                96,
                1024,
            )
            for i in range(nodes)
        }
    )
    far = T0 + timedelta(days=3650)
    jobs = [
        RunningJob(f"run-{i}-{k}", 1, 1, "vision", [_replica(i)], T0, far, RunEnd.SUCCEEDED)
        for i in range(nodes)
        for k in range(per_node)
    ]
    executor = Executor(
        CLUSTER,
        book,
        _ExecutorStore(jobs),  # type: ignore[arg-type]
        _Relay(),  # type: ignore[arg-type]
        ExecutorMetrics(CollectorRegistry()),
        time_scale=1,
        default_duration_s=36_000,
    )
    await executor.restore()
    header = (("cluster", CLUSTER.encode()),)

    def placement(i: int) -> ConsumerRecord:
        job_id = f"new-{i}"
        p = PlacementDecided(
            job_id=job_id,
            attempt=1,
            epoch=1,
            leader="bench",
            cluster=CLUSTER,
            accelerator_type="H100",
            spec=SPEC.model_copy(update={"job_id": job_id}),
            replicas=[_replica(i % nodes)],
        )
        return _record(topics.PLACEMENT_DECIDED, "PlacementDecided", p, header)

    each = 50
    placements = [placement(i) for i in range(rounds * each)]
    placed = await _atimed(rounds, each, lambda i: executor.process((placements[i],)))

    def lost(i: int) -> ConsumerRecord:
        down = NodeUnhealthy(
            node_id=_node_id(nodes - 1 - i),
            cluster=CLUSTER,
            cause="xid_79",
            signals=["bench"],
            since=T0,
            incident_id=f"inc-{i}",
        )
        return _record(topics.NODE_UNHEALTHY, "NodeUnhealthy", down)

    each = max(1, min(20, nodes // (2 * rounds)))
    downs = [lost(i) for i in range(rounds * each)]
    gone = await _atimed(rounds, each, lambda i: executor.process((downs[i],)))
    return placed, gone


async def meter_pass(open_runs: int, rounds: int) -> float:
    for name in ("add_interval_usage", "save_billed", "add_budget_usage"):
        setattr(meter_store, name, _nothing)

    async def insert_ticks(_conn: Any, ticks: list[Any]) -> list[Any]:
        return list(ticks)

    meter_store.insert_ticks = insert_ticks  # type: ignore[assignment]
    grid = Grid.of(60, 1)
    meter = Meter(
        None,  # type: ignore[arg-type]
        _Relay(),  # type: ignore[arg-type]
        grid,
        MeterConfig(),
        PriceBook(node_tiers={}, configured={}, fallback={}),
        MeterMetrics(CollectorRegistry()),
        lag_s=0,
        idle_lag_s=0,
        max_ticks_per_pass=10**9,
        max_idle_backfill=1,
    )
    meter.idle_done = 10**12  # no idle accounting
    for i in range(open_runs):
        run = Run(
            f"job-{i}",
            1,
            "vision",
            "p",
            "u",
            CLUSTER,
            "H100",
            (Share("reserved", micros("1"), micros("2.10")),),
            start_v=grid.virtual(T0),
        )
        state = RunState(f"job-{i}", 1, phase=Phase.OPEN, run=run)
        meter.open[state.key] = state
    now = T0 + timedelta(minutes=10, seconds=5)
    await meter.tick(now)  # bills every run through the last closed interval
    return await _atimed(rounds, 5, lambda i: meter.tick(now + timedelta(seconds=1 + i * 0.01)))


RULES = HealthRules(
    rules=(),
    timings=Timings(
        suspect_after_s=15,
        unhealthy_after_s=30,
        min_quarantine_s=60,
        clean_period_s=120,
        cluster_min_nodes=2,
    ),
)


def health_costs(nodes: int, beats: int, rounds: int) -> tuple[float, float, float]:
    ids = itertools.count()
    book = HealthBook()
    names = [_node_id(i) for i in range(nodes)]

    def step(fn: Callable[[Draft], None]) -> Any:
        draft = Draft(book, RULES, lambda: f"inc-{next(ids)}")
        fn(draft)
        book.apply(draft.changes)
        return draft.changes

    step(lambda d: inventory_seen(d, CLUSTER, names, T0))
    step(lambda d: heartbeats_seen(d, [Beat(n, CLUSTER, T0) for n in names]))
    monitor = HealthMonitor(
        None,  # type: ignore[arg-type]
        _Relay(),  # type: ignore[arg-type]
        book,
        RULES,
        HealthMetrics(CollectorRegistry()),
        clock=lambda: T0,
        new_id=lambda: f"inc-{next(ids)}",
    )

    def batch(i: int) -> None:
        at = T0 + timedelta(seconds=1 + i * 0.001)
        draft = Draft(book, RULES, lambda: f"inc-{next(ids)}")
        start = (i * beats) % nodes
        heartbeats_seen(
            draft, [Beat(names[(start + k) % nodes], CLUSTER, at) for k in range(beats)]
        )
        monitor._committed(draft.changes)

    counted = _timed(rounds, 20, batch)
    # Steady traffic, one simulated second at a time: every node heartbeats every 5 s and a
    # gang of four on every four nodes reports its progress every 2 s, and the clock's pass
    # runs once a second. Only the passes are timed, after a minute's warm-up (entries then
    # come due in the indexes as fast as they go in).
    gangs = nodes // 4

    def report(g: int, at: datetime) -> Progress:
        steps = tuple(ReplicaStep(k, names[4 * g + k], 1.0) for k in range(4))
        return Progress(f"gang-{g}", 1, CLUSTER, steps, at)

    def second(s: int) -> float:
        at = T0 + timedelta(seconds=s)
        beats = [Beat(n, CLUSTER, at) for n in names[s % 5 :: 5]]
        step(lambda d: heartbeats_seen(d, beats))
        step(lambda d: progress_seen(d, [report(g, at) for g in range(s % 2, gangs, 2)], at))
        t = time.perf_counter()
        changes = step(lambda d: (check(d, at, T0), expired(d, at, T0)))
        took = time.perf_counter() - t
        assert not changes, "a healthy fleet: the pass decides nothing"
        return took

    for s in range(1, 61):
        second(s)
    took = [second(s) for s in range(61, 61 + 5 * rounds)]
    passed = statistics.median(statistics.fmean(took[r * 5 : (r + 1) * 5]) for r in range(rounds))
    end = 61 + 5 * rounds

    # Then the whole cluster goes dark (one cluster incident), and every node is heard again.
    def after(seconds: int) -> datetime:
        return T0 + timedelta(seconds=end + seconds)

    step(lambda d: check(d, after(40), T0))
    assert len(book.incidents) == 1, book.incidents
    # Heard again from 45 s on, with the clock's pass every 5 s: the clean period (counted
    # from 45 s) is over at 165 s.
    for s in range(45, 170, 5):
        back = after(s)
        step(lambda d, back=back: heartbeats_seen(d, [Beat(n, CLUSTER, back) for n in names]))
        if s < 165:
            assert not step(lambda d, back=back: check(d, back, T0)).recovered
    t = time.perf_counter()
    changes = step(lambda d: check(d, after(165), T0))
    recovery = time.perf_counter() - t
    assert len(changes.recovered) == nodes and not book.incidents, len(changes.recovered)
    return counted, passed, recovery


def health_slow_reports(nodes: int, rounds: int) -> float:
    """Seconds per progress report of a gang with a straggler on it while every other node
    of the cluster is out with an incident of its own (an outage)."""
    names = [_node_id(i) for i in range(nodes)]
    book = HealthBook()
    for node_id in names[:-4]:
        incident_id = f"out-{node_id}"
        book.incidents[incident_id] = Incident(
            incident_id, node_id, CLUSTER, node_id, "xid_79", Severity.CRITICAL, "", T0, T0, 1
        )
        book.nodes[node_id] = NodeHealth(
            node_id,
            CLUSTER,
            state=NodeState.UNHEALTHY,
            last_heard=T0,
            incident_id=incident_id,
            cause="xid_79",
            quarantined_at=T0,
            last_bad_at=T0,
        )
    for node_id in names[-4:]:
        book.nodes[node_id] = NodeHealth(node_id, CLUSTER, last_heard=T0)
    recount = getattr(book, "recount", None)
    if recount is not None:  # the indexes of what was filled in directly
        recount()
    ids = itertools.count()

    def report(i: int) -> None:
        at = T0 + timedelta(seconds=1 + i)
        steps = tuple(ReplicaStep(k, n, 3.0 if k == 3 else 1.0) for k, n in enumerate(names[-4:]))
        draft = Draft(book, RULES, lambda: f"inc-{next(ids)}")
        progress_seen(draft, [Progress("gang", 1, CLUSTER, steps, at)], at)
        book.apply(draft.changes)

    for i in range(5):  # slow in 3 of the last 5: a straggler, with its incident
        report(i)
    assert any(i.cause == STRAGGLER for i in book.incidents.values())
    return _timed(rounds, 20, lambda i: report(5 + i))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,5000", help="nodes per cluster")
    parser.add_argument("--runs-per-node", type=int, default=4)
    parser.add_argument("--beats", type=int, default=100, help="heartbeats per health batch")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    # A node lost logs a warning: thousands of them here.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    health_store.save = _nothing  # type: ignore[assignment]
    figures: dict[str, dict[str, float]] = {k: {} for k in FIGURES}
    print(
        f"{'nodes':>6} {'runs':>7} {'placement us':>13} {'node lost us':>13} "
        f"{'meter pass us':>14} {'health batch us':>16} {'health pass us':>15} "
        f"{'slow report us':>15} {'recovery ms':>12}"
    )
    for nodes in sizes:
        runs = nodes * args.runs_per_node
        placed, lost = await executor_costs(nodes, args.runs_per_node, args.rounds)
        passed = await meter_pass(runs, args.rounds)
        counted, passed_h, recovery = health_costs(nodes, min(args.beats, nodes), args.rounds)
        row = {
            "executor_placement_us": _median_us([placed]),
            "executor_node_lost_us": _median_us([lost]),
            "meter_pass_us": _median_us([passed]),
            "health_batch_us": _median_us([counted]),
            "health_pass_us": _median_us([passed_h]),
            "health_slow_report_us": _median_us([health_slow_reports(nodes, args.rounds)]),
            "health_recovery_ms": round(recovery * 1e3, 1),
        }
        for key, value in row.items():
            figures[key][str(nodes)] = value
        print(
            f"{nodes:>6} {runs:>7} {row['executor_placement_us']:>13} "
            f"{row['executor_node_lost_us']:>13} {row['meter_pass_us']:>14} "
            f"{row['health_batch_us']:>16} {row['health_pass_us']:>15} "
            f"{row['health_slow_report_us']:>15} {row['health_recovery_ms']:>12}"
        )
    setup = {
        **describe(),
        "sizes": sizes,
        "devices_per_node": 8,
        "runs_per_node": args.runs_per_node,
        "beats_per_batch": args.beats,
        "rounds": args.rounds,
    }
    print(json.dumps({"bench": "fleet_scale", **figures, "setup": setup}))


if __name__ == "__main__":
    asyncio.run(main())
