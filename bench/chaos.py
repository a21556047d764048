"""Chaos: submit jobs at a steady rate while the queue, scheduler, executors and health service
are killed (-9) and restarted at seeded random moments; then audit what the log says happened.

Prints, per the BENCH.md keys: jobs, terminal_once (jobs with exactly one terminal event),
lost (none), duplicate_effects (a run started twice, a job ended twice), double_allocations
(a node holding more than it has, rebuilt from the executors' own events) and kills.

    python bench/chaos.py                   # 40 jobs/s for 60 s, a kill every ~6 s
    python bench/chaos.py --rate 100 --seconds 120
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokafka import AIOKafkaProducer

from bench.machine import describe
from cli import infra
from cli.stack import PROJECT_ROOT, Stack
from core.fleet import load_fleet
from schemas import topics
from schemas.envelope import Envelope
from services.common.policyfile import load_policy, read_yaml
from tests.integration.kafka_tools import collect

TENANTS = ("vision", "nlp", "speech")
VICTIMS = ("services.queue", "services.scheduler", "services.executor", "services.health")


def job(rng: random.Random, job_id: str, i: int) -> dict[str, Any]:
    replicas, gpus = (2, 8) if rng.random() < 0.1 else (1, rng.choice([1, 2, 4]))
    return {
        "job_id": job_id,
        "tenant": TENANTS[i % 3],
        "replicas": replicas,
        "resources": {"accelerators": gpus},
        "labels": {"sim_duration_s": str(rng.randint(60, 600))},
    }


async def submit(
    bootstrap: str, rng: random.Random, rate: float, seconds: float, run: str
) -> list[str]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    ids: list[str] = []
    start = time.monotonic()
    try:
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            job_id = f"chaos-{run}-{i}"
            env = Envelope(type="JobSubmitted", producer="chaos", payload=job(rng, job_id, i))
            await producer.send(
                topics.JOB_SUBMITTED, env.model_dump_json().encode(), key=job_id.encode()
            )
            ids.append(job_id)
    finally:
        await producer.stop()
    return ids


async def kill_loop(
    stack: Stack, rng: random.Random, every_s: float, until: float, kills: list[str]
) -> None:
    victims = [s for s in stack.services if s.module in VICTIMS]
    while time.monotonic() < until:
        await asyncio.sleep(rng.uniform(0.5, 1.5) * every_s)
        service = rng.choice(victims)
        assert service.pid is not None
        os.kill(service.pid, signal.SIGKILL)
        kills.append(service.name)
        await asyncio.sleep(rng.uniform(0.2, 2.0))
        await asyncio.to_thread(stack.restart, service)


async def audit(bootstrap: str, ids: set[str], timeout_s: float) -> dict[str, Any]:
    watched = (topics.JOB_FINISHED, topics.JOB_REJECTED)
    deadline = time.monotonic() + timeout_s
    while True:
        ends = await collect(
            bootstrap,
            watched,
            lambda _t, e: e["payload"].get("job_id") in ids,
            count=10**9,
            timeout_s=5,
        )
        if (
            len({e["payload"]["job_id"] for _, e in ends}) >= len(ids)
            or time.monotonic() > deadline
        ):
            break
    events = await collect(
        bootstrap,
        (topics.PLACEMENT_DECIDED, topics.JOB_STARTED, topics.JOB_PREEMPTED),
        lambda _t, e: e["payload"].get("job_id") in ids,
        count=10**9,
        timeout_s=8,
    )
    terminal: dict[str, int] = defaultdict(int)
    for _, env in ends:
        terminal[env["payload"]["job_id"]] += 1
    starts: dict[tuple[str, int], int] = defaultdict(int)
    for topic, env in events:
        if topic == topics.JOB_STARTED:
            starts[(env["payload"]["job_id"], env["payload"]["attempt"])] += 1
    return {
        "terminal_once": sum(1 for j in ids if terminal.get(j) == 1),
        "lost": sum(1 for j in ids if j not in terminal),
        "duplicate_effects": sum(1 for n in terminal.values() if n > 1)
        + sum(1 for n in starts.values() if n > 1),
        "double_allocations": overcommitted_nodes(events + ends),
    }


def overcommitted_nodes(events: list[tuple[str, dict[str, Any]]]) -> int:
    """Nodes that ever held more than they have, from started/ended runs and placements."""
    policy = load_policy(PROJECT_ROOT / "examples" / "policy.yaml")
    _, nodes = load_fleet(
        read_yaml(PROJECT_ROOT / "examples" / "fleet.yaml"), policy.accelerator_types
    )
    placements = {
        (e["payload"]["job_id"], e["payload"]["attempt"]): e["payload"]
        for t, e in events
        if t == topics.PLACEMENT_DECIDED
    }
    timeline = []
    for topic, env in events:
        p = env["payload"]
        run = placements.get((p["job_id"], p.get("attempt")))
        if run is None or topic == topics.PLACEMENT_DECIDED or topic == topics.JOB_REJECTED:
            continue
        sign = 1 if topic == topics.JOB_STARTED else -1
        for rep in run["replicas"]:
            timeline.append(
                (env["occurred_at"], sign > 0, sign * rep["accelerators"], rep["node_id"])
            )
    use: dict[str, float] = defaultdict(float)
    bad: set[str] = set()
    for _at, _starts, amount, node in sorted(timeline):  # ends before starts at one instant
        use[node] += amount
        if use[node] > nodes[node].accelerators + 1e-9:  # type: ignore[index]
            bad.add(node)
    return len(bad)


async def run(stack: Stack, bootstrap: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    kills: list[str] = []
    until = time.monotonic() + args.seconds
    killer = asyncio.create_task(
        kill_loop(stack, random.Random(args.seed + 1), args.kill_every, until, kills)
    )
    ids = await submit(bootstrap, rng, args.rate, args.seconds, f"{args.seed}")
    await killer
    print(f"submitted {len(ids)} jobs; {len(kills)} kills: {', '.join(kills)}")
    figures = await audit(bootstrap, set(ids), args.drain_s)
    return {"jobs": len(ids), **figures, "kills": len(kills)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=6.0)
    parser.add_argument("--drain-s", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qm-chaos-") as tmp:
        kafka = infra.start_kafka(Path(tmp) / "kafka")
        try:
            stack = Stack.start(
                Path(tmp) / "state",
                gateway_port=infra.free_port(),
                env={"QM_KAFKA_BOOTSTRAP": kafka.url},
                time_scale=600.0,
            )
            try:
                figures = asyncio.run(run(stack, kafka.url, args))
            finally:
                stack.stop()
        finally:
            infra.stop(kafka)
    print(
        f"jobs {figures['jobs']}: terminal once {figures['terminal_once']}, lost "
        f"{figures['lost']}, duplicate effects {figures['duplicate_effects']}, "
        f"over-committed nodes {figures['double_allocations']}, kills {figures['kills']}"
    )
    print(
        json.dumps(
            {
                "bench": "chaos",
                **figures,
                "setup": {
                    **describe(),
                    "rate_per_s": args.rate,
                    "seconds": args.seconds,
                    "kill_every_s": args.kill_every,
                    "seed": args.seed,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
