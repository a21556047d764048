"""Benchmark: what one live scheduler cycle costs as the fleet fills, with one job arriving at a
time. The leader's `Cycle.decide` runs on a `SchedulerState` fed by the same events the feed
applies (capacity, job.queued, placement.decided read back, job.finished), at several counts
of running allocations on a 1,200-node fleet, two ways in the same run:

- `kept`: the working set is kept from cycle to cycle and updated by what changed (the
  scheduler's way, `services/scheduler/working.py`);
- `rebuilt`: the working set is rebuilt from a snapshot for every cycle (the way before it).

Each step: one job arrives, the cycle decides (timed), its placement is applied as the broker
acknowledged it, and the oldest running job finishes, so the running count holds. Prints the
figures, then one JSON line (see shared BENCH.md).

    python bench/scheduler_cycle.py [--nodes 1200] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.inventory import inventory
from bench.machine import describe
from core.policy import Policy
from schemas.events import ClusterCapacity, JobFinished, JobQueued, Outcome
from schemas.job import JobSpec
from services.scheduler.cycle import Cycle
from services.scheduler.handlers import SchedulerMetrics
from services.scheduler.state import SchedulerState
from services.scheduler.working import WorkingSet

NOW = 1_800_000_000.0
TENANTS = ("vision", "nlp", "speech", "research")
POLICY = Policy.from_dict(
    {"tenants": {t: {"cohort": "all", "quotas": {"H100": 4000, "A100": 4000}} for t in TENANTS}}
)


def capacity(cluster: str, kind: str, count: int) -> ClusterCapacity:
    return inventory(
        cluster,
        kind,
        count,
        cpu=128,
        memory_gb=1024,
        name="{cluster}-n{i:05d}",
        rack_size=8,
        block_size=64,
        generation="g",
        relative_speed=2.0,
    )


def queued(i: int) -> JobQueued:
    spec = JobSpec.model_validate(
        {
            "job_id": f"job-{i:07d}",
            "tenant": TENANTS[i % len(TENANTS)],
            "resources": {"accelerators": 1, "cpu": 4, "memory_gb": 32},
        }
    )
    return JobQueued(
        job_id=spec.job_id, spec=spec, submitted_at=datetime.fromtimestamp(NOW + i, UTC)
    )


class Bench:
    def __init__(self, nodes: int, keep: bool) -> None:
        self.state = SchedulerState()
        half = nodes // 2
        self.state.on_capacity(capacity("east", "H100", half))
        self.state.on_capacity(capacity("west", "A100", nodes - half))
        self.keep = keep
        self.working = WorkingSet()
        metrics = SchedulerMetrics(CollectorRegistry())
        self.cycle = Cycle(self.state, POLICY, None, metrics, "bench", working=self.working)  # type: ignore[arg-type]
        self.jobs = 0
        self.order: deque[str] = deque()
        self.now = NOW

    def step(self) -> float:
        """One arrival, one timed decision, its placement applied; returns seconds."""
        self.jobs += 1
        self.state.on_queued(queued(self.jobs))
        self.now += 0.01
        if not self.keep:
            self.working.invalidate()
        started = time.perf_counter()
        decisions = self.cycle.decide(epoch=1, now=self.now)
        took = time.perf_counter() - started
        self.cycle.apply(decisions, [None] * len(decisions.messages()))
        self.order.extend(str(event.job_id) for _, event in decisions.placements)
        return took

    def fill(self, running: int) -> None:
        """Places jobs (many per cycle) until `running` allocations hold."""
        while len(self.state.running) < running:
            for _ in range(min(500, running - len(self.state.running))):
                self.jobs += 1
                self.state.on_queued(queued(self.jobs))
            decisions = self.cycle.decide(epoch=1, now=self.now)
            self.cycle.apply(decisions, [None] * len(decisions.messages()))
            self.order.extend(str(event.job_id) for _, event in decisions.placements)

    def finish_oldest(self) -> None:
        job_id = self.order.popleft()
        self.state.on_finished(JobFinished(job_id=job_id, outcome=Outcome.SUCCEEDED, attempt=1))


def measure(nodes: int, running: int, steps: int, keep: bool) -> float:
    bench = Bench(nodes, keep)
    bench.fill(running)
    times = []
    for _ in range(steps):
        times.append(bench.step())
        bench.finish_oldest()
    assert abs(len(bench.state.running) - running) <= 1, len(bench.state.running)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1200)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    levels = [0, 2_000, 6_000, 9_000]
    levels = [r for r in levels if r < args.nodes * 8]
    kept: dict[str, float] = {}
    rebuilt: dict[str, float] = {}
    print(f"fleet: {args.nodes} nodes x 8 accelerators; one 1-accelerator job per cycle")
    print(f"{'running':>8} {'kept ms':>9} {'rebuilt ms':>11} {'ratio':>7}")
    for running in levels:
        # Alternated at each level, so drift in the machine's speed hits both alike.
        a = measure(args.nodes, running, args.steps, keep=True)
        b = measure(args.nodes, running, args.steps, keep=False)
        kept[str(running)], rebuilt[str(running)] = round(a * 1000, 3), round(b * 1000, 3)
        print(f"{running:>8} {a * 1000:>9.2f} {b * 1000:>11.2f} {b / a:>6.1f}x")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "bench": "scheduler_cycle",
                "cycle_ms": kept,
                "cycle_ms_rebuilt": rebuilt,
                "nodes": args.nodes,
                "peak_rss_mb": round(peak_rss_mb, 1),
                "setup": {
                    **describe(),
                    "accelerators": args.nodes * 8,
                    "steps": args.steps,
                    "job": "1 accelerator, 1 replica, one arriving per cycle",
                },
            }
        )
    )


if __name__ == "__main__":
    main()
