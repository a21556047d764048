"""Chaos: submit jobs at a steady rate while every kind of service (gateway, queue, the
scheduler as leader and as standby, preemptor, each executor, health, meter) is killed (-9)
and restarted, and the leading scheduler is frozen (SIGSTOP) for longer than its lease and
then let go on, by a seeded plan drawn up front (`fault_plan`: every target at least once,
whatever the timing); then audit what the log says happened.

The mix keeps every failure path busy: long low-priority runs fill the H100 cluster and
critical H100 gangs preempt them (checkpoint, grace, stop, requeue); some jobs fail once and
are retried, some fail for good; the rest are short jobs on the other clusters.

Prints, per the BENCH.md keys: jobs, terminal_once (jobs with exactly one terminal event),
lost (none), duplicate_effects (a run started, preempted or ordered to stop twice, a job ended
twice), double_allocations (a node holding more than it has, rebuilt from the executors' own
events), wrong_outcome (a job that ended other than its labels say it must), preemptions,
retries, kills and leader freezes.

    python bench/chaos.py                   # 40 jobs/s for 60 s, a kill every ~6 s
    python bench/chaos.py --rate 100 --seconds 120
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokafka import AIOKafkaProducer

from bench.machine import describe
from cli import infra
from cli.stack import PROJECT_ROOT, REGISTRY_PARTITIONS, Service, Stack
from core.fleet import load_fleet, load_pools
from schemas import topics
from schemas.envelope import Envelope
from services.common.policyfile import load_policy, read_yaml
from tests.integration.kafka_tools import LogReader

TENANTS = ("vision", "nlp", "speech")
NOT_H100 = ["A100", "L4", "TPU-v5e"]


def job(rng: random.Random, job_id: str, i: int) -> dict[str, Any]:
    """One job of the mix; `sim_outcome` / `sim_fail_attempts` say how it must end."""
    roll = rng.random()
    spec: dict[str, Any] = {"job_id": job_id, "tenant": TENANTS[i % 3]}
    if roll < 0.04:  # long low-priority runs that fill the H100 cluster: the victims
        duration = rng.randint(3000, 6000)
        spec |= {
            "priority_class": "low",
            "resources": {"accelerators": 8, "accelerator_types": ["H100"]},
            "labels": {"sim_checkpoint_every_s": "600"},
        }
    elif roll < 0.06:  # critical gangs that need two whole H100 nodes: the preemptors
        duration = rng.randint(300, 900)
        spec |= {
            "tenant": "nlp",
            "priority_class": "critical",
            "replicas": 2,
            "resources": {"accelerators": 8, "accelerator_types": ["H100"]},
        }
    elif roll < 0.14:  # gangs elsewhere
        duration = rng.randint(60, 600)
        spec |= {"replicas": 2, "resources": {"accelerators": 8, "accelerator_types": ["A100"]}}
    else:
        duration = rng.randint(60, 600)
        spec |= {
            "resources": {"accelerators": rng.choice([1, 2, 4]), "accelerator_types": NOT_H100}
        }
    labels = {**spec.get("labels", {}), "sim_duration_s": str(duration)}
    failure = rng.random()
    if failure < 0.03:  # fails once, then succeeds on its retry
        labels["sim_fail_attempts"] = "1"
    elif failure < 0.04:  # fails on every run: ends failed once its one retry is used
        labels["sim_outcome"] = "failed"
        spec["retry"] = {"max_retries": 1}
    return {**spec, "labels": labels}


async def submit(
    bootstrap: str, rng: random.Random, rate: float, seconds: float, run: str
) -> dict[str, str]:
    """Submits the mix; returns each job's expected outcome."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    ids: dict[str, str] = {}
    start = time.monotonic()
    try:
        for i in range(int(rate * seconds)):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            job_id = f"chaos-{run}-{i}"
            spec = job(rng, job_id, i)
            env = Envelope(type="JobSubmitted", producer="chaos", payload=spec)
            await producer.send(
                topics.JOB_SUBMITTED, env.model_dump_json().encode(), key=job_id.encode()
            )
            ids[job_id] = spec["labels"].get("sim_outcome", "succeeded")
    finally:
        await producer.stop()
    return ids


FREEZE = "freeze the leading scheduler"


def leading_scheduler(stack: Stack) -> Service | None:
    """The scheduler process that reports itself leader on its /metrics, if one does."""
    for service in stack.services:
        if service.module != "services.scheduler":
            continue
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{service.port}/metrics", timeout=2) as r:
                if "qm_scheduler_is_leader 1.0" in r.read().decode():
                    return service
        except OSError:
            continue
    return None


LEADER = "scheduler (leader)"
STANDBY = "scheduler (standby)"


@dataclass(frozen=True)
class Fault:
    """One planned fault: at `at_s` seconds into the run, `target` (a service name, LEADER,
    STANDBY or FREEZE) is killed (-9) and restarted after `down_s`, or, for FREEZE, the
    leading scheduler is stopped for `down_s` (longer than its 3 s lease)."""

    at_s: float
    target: str
    down_s: float


def fault_targets(stack_names: list[str]) -> list[str]:
    """Every kind of service the stack runs, the scheduler as leader and as standby (which
    process is which is only known when the fault fires)."""
    targets = [n for n in stack_names if not n.startswith("scheduler")]
    return [*sorted(targets), LEADER, STANDBY]


def fault_plan(
    targets: list[str], seconds: float, every_s: float, seed: int, freezes: int = 1
) -> list[Fault]:
    """A complete, seeded schedule: every target at least once (more rounds if the run is
    long enough), `freezes` leader freezes per round, in a shuffled order, one fault per
    slot of the run at a jittered moment inside it. Drawn up front, so which services are hit
    never depends on timing: the run executes each fault, however late, and reports it."""
    rng = random.Random(seed)
    per_round = [*targets, *[FREEZE] * freezes]
    rounds = max(1, int(seconds // (every_s * len(per_round))))
    order: list[str] = []
    for _ in range(rounds):
        batch = list(per_round)
        rng.shuffle(batch)
        order.extend(batch)
    slot = seconds / len(order)
    plan = []
    for i, target in enumerate(order):
        at = i * slot + rng.uniform(0.1, 0.5) * slot
        down = rng.uniform(4.0, 6.0) if target == FREEZE else rng.uniform(0.2, 2.0)
        plan.append(Fault(round(at, 3), target, round(down, 3)))
    return plan


def _scheduler_roles(stack: Stack) -> tuple[Service | None, Service | None]:
    leader = leading_scheduler(stack)
    others = [s for s in stack.services if s.module == "services.scheduler" and s is not leader]
    return leader, (others[0] if others else None)


async def run_faults(stack: Stack, plan: list[Fault], started: float, done: list[str]) -> None:
    """Execute `plan` in order; `done` gets one entry per executed fault (its target kind and
    the process hit). A fault whose moment has passed (the previous one took long) runs at
    once; none is skipped. A leader is waited for (a freeze or a leader kill needs one)."""
    for fault in plan:
        await asyncio.sleep(max(0.0, started + fault.at_s - time.monotonic()))
        victim: Service | None
        if fault.target in (FREEZE, LEADER, STANDBY):
            deadline = time.monotonic() + 30
            while True:
                leader, standby = await asyncio.to_thread(_scheduler_roles, stack)
                victim = standby if fault.target == STANDBY else leader
                if (victim is not None and victim.pid is not None) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            if victim is None or victim.pid is None:
                raise RuntimeError(f"fault {fault} found no scheduler in that role")
        else:
            victim = next(s for s in stack.services if s.name == fault.target)
        assert victim.pid is not None
        if fault.target == FREEZE:
            os.kill(victim.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(fault.down_s)
            finally:
                os.kill(victim.pid, signal.SIGCONT)
        else:
            os.kill(victim.pid, signal.SIGKILL)
            await asyncio.sleep(fault.down_s)
            await asyncio.to_thread(stack.restart, victim)
        done.append(f"{fault.target}={victim.name}")


# Topics where one (job, attempt) may have one effect only (distinct event ids).
ONCE_PER_RUN = (
    topics.JOB_STARTED,
    topics.JOB_PREEMPTED,
    topics.JOB_RUN_FAILED,
    topics.JOB_PREEMPT_ORDERED,
    topics.JOB_CHECKPOINT_REQUESTED,
)


async def audit(bootstrap: str, expected: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Waits (up to `timeout_s`) until every job has ended, then reads the whole log to its end
    and counts what happened. Counting from a complete read matters: a time-boxed read of a
    big log misses records and reports them as lost."""
    ids = set(expected)
    watched = (topics.JOB_FINISHED, topics.JOB_REJECTED)
    deadline = time.monotonic() + timeout_s
    async with LogReader(bootstrap, watched) as ends_log:
        while True:
            ended = {e["payload"].get("job_id") for _, e in await ends_log.read_to_end(timeout_s)}
            if ids <= ended or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
        ends = [(t, e) for t, e in ends_log.events if e["payload"].get("job_id") in ids]
    async with LogReader(bootstrap, (topics.PLACEMENT_DECIDED, *ONCE_PER_RUN)) as runs_log:
        events = [
            (t, e)
            for t, e in await runs_log.read_to_end(timeout_s)
            if e["payload"].get("job_id") in ids
        ]
    # The same event (same id) read twice is a retransmission (an outbox row published again
    # after a crash or a store outage), which every consumer skips by id: not a second effect.
    # Two events with different ids for one run are.
    total = len(ends) + len(events)
    ends, events = first_copies(ends), first_copies(events)
    redelivered = total - len(ends) - len(events)
    terminal: dict[str, int] = defaultdict(int)
    outcome: dict[str, str] = {}
    for _, env in ends:
        terminal[env["payload"]["job_id"]] += 1
        outcome[env["payload"]["job_id"]] = env["payload"].get("outcome", "rejected")
    effects: dict[tuple[str, str, int], int] = defaultdict(int)
    for topic, env in events:
        if topic in ONCE_PER_RUN:
            effects[(topic, env["payload"]["job_id"], env["payload"]["attempt"])] += 1
    dup_topics: dict[str, int] = defaultdict(int)
    for (topic, _job, _attempt), n in effects.items():
        if n > 1:
            dup_topics[topic] += 1
    dup_topics.update({"terminal": sum(1 for n in terminal.values() if n > 1)})
    preempted = [e for t, e in events if t == topics.JOB_PREEMPTED and e["payload"].get("for_job")]
    samples = forensics(ends + events, terminal, ids)
    overcommits: dict[str, list[str]] = {}
    return {
        "samples": samples,
        "terminal_once": sum(1 for j in ids if terminal.get(j) == 1),
        "lost": sum(1 for j in ids if j not in terminal),
        "duplicate_effects": sum(dup_topics.values()),
        "double_allocations": overcommitted_nodes(events + ends, overcommits),
        "wrong_outcome": sum(1 for j, want in expected.items() if outcome.get(j, want) != want),
        "preemptions": len(preempted),
        "checkpoints": sum(1 for t, _ in events if t == topics.JOB_CHECKPOINT_REQUESTED),
        "retries": sum(1 for t, _ in events if t == topics.JOB_RUN_FAILED),
        "duplicates_by_topic": {t: n for t, n in dup_topics.items() if n},
        "redelivered": redelivered,
        "overcommits": overcommits,
    }


def first_copies(
    records: list[tuple[str, dict[str, Any]]],
) -> list[tuple[str, dict[str, Any]]]:
    """Each event once, by envelope id, in log order."""
    seen: set[str] = set()
    out = []
    for topic, env in records:
        event_id = env.get("event_id")
        if event_id in seen:
            continue
        if event_id is not None:
            seen.add(event_id)
        out.append((topic, env))
    return out


def forensics(
    events: list[tuple[str, dict[str, Any]]], terminal: dict[str, int], ids: set[str]
) -> dict[str, list[str]]:
    """The log of a few jobs that ended twice or never, to read when the audit fails."""
    twice = sorted(j for j, n in terminal.items() if n > 1)[:3]
    never = sorted(j for j in ids if j not in terminal)[:3]
    out: dict[str, list[str]] = {}
    for job_id in twice + never:
        lines = []
        for topic, env in sorted(events, key=lambda te: te[1]["occurred_at"]):
            p = env["payload"]
            if p.get("job_id") != job_id:
                continue
            lines.append(
                f"{env['occurred_at'][11:23]} {topic} by {env.get('producer')} attempt "
                f"{p.get('attempt')} {p.get('outcome') or p.get('reason_code') or ''} "
                f"{'epoch ' + str(p['epoch']) + ' ' if 'epoch' in p else ''}"
                f"{[r['node_id'] for r in p.get('replicas', [])] or p.get('nodes') or ''}"
            )
        out[job_id] = lines
    return out


# A run holds its devices from job.started until one of the others.
RUN_EDGES = (topics.JOB_STARTED, topics.JOB_FINISHED, topics.JOB_PREEMPTED, topics.JOB_RUN_FAILED)


def overcommitted_nodes(
    events: list[tuple[str, dict[str, Any]]], detail: dict[str, list[str]] | None = None
) -> int:
    """Nodes that ever held more than they have, from started/ended runs and placements.
    `detail`, when given, receives each such node's run edges up to the first excess (the
    forensics a failed audit prints)."""
    policy = load_policy(PROJECT_ROOT / "examples" / "policy.yaml")
    doc = read_yaml(PROJECT_ROOT / "examples" / "fleet.yaml")
    _, fixed = load_fleet(doc, policy.accelerator_types)
    devices = {str(n): node.accelerators for n, node in fixed.items()}
    # Elastic pools' nodes are named <cluster>-<pool>-<number> (services/executor/pools.py).
    pool_sizes = {
        f"{cluster}-{p.name}-": p.accelerators_per_node
        for cluster, pools in load_pools(doc, policy.accelerator_types, policy.prices).items()
        for p in pools
    }

    def size(node: str) -> int:
        if node in devices:
            return devices[node]
        prefix = node.rsplit("-", 1)[0] + "-"
        return pool_sizes[prefix]

    # Two leaders may have placed one attempt (the deposed one's copy is refused by the
    # executor): a run's devices are those of the copy whose nodes it started on.
    placements: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for t, e in events:
        if t == topics.PLACEMENT_DECIDED and e["type"] != topics.LEADER_FENCE:
            p = e["payload"]
            placements[(p["job_id"], p["attempt"], p["cluster"])].append(p)
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for t, e in events:
        p = e["payload"]
        if t != topics.JOB_STARTED:
            continue
        key = (p["job_id"], p["attempt"], p["cluster"])
        if copies := placements.get(key):
            ran = [c for c in copies if {r["node_id"] for r in c["replicas"]} == set(p["nodes"])]
            runs[key] = (ran or copies)[0]["replicas"]
    timeline = []
    for topic, env in events:
        p = env["payload"]
        if topic not in RUN_EDGES or p.get("attempt") is None or p.get("cluster") is None:
            continue
        replicas = runs.get((p["job_id"], p["attempt"], p["cluster"]))
        if replicas is None:
            continue
        sign = 1 if topic == topics.JOB_STARTED else -1
        for rep in replicas:
            run = f"{p['job_id']}#{p['attempt']} {topic} by {env.get('producer')}"
            timeline.append(
                (env["occurred_at"], sign > 0, sign * rep["accelerators"], rep["node_id"], run)
            )
    use: dict[str, float] = defaultdict(float)
    seen: dict[str, list[str]] = defaultdict(list)
    bad: set[str] = set()
    for at, _starts, amount, node, run in sorted(timeline):  # ends before starts at one instant
        use[node] += amount
        seen[node].append(f"{at} {amount:+g} -> {use[node]:g} {run}")
        if use[node] > size(node) + 1e-9:
            if detail is not None and node not in bad and len(detail) < 3:
                detail[node] = seen[node][-8:]
            bad.add(node)
    return len(bad)


async def run(stack: Stack, bootstrap: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    plan = fault_plan(
        fault_targets([s.name for s in stack.services]),
        args.seconds,
        args.kill_every,
        args.seed + 1,
        args.freeze_share,
    )
    print(f"fault plan ({len(plan)}): " + ", ".join(f"{f.at_s:.0f}s {f.target}" for f in plan))
    done: list[str] = []
    faults = asyncio.create_task(run_faults(stack, plan, time.monotonic(), done))
    run_id = f"{args.seed}-{uuid.uuid4().hex[:6]}"  # ids unique across runs on one database
    expected = await submit(bootstrap, rng, args.rate, args.seconds, run_id)
    await faults
    print(f"submitted {len(expected)} jobs; {len(done)} faults: {', '.join(done)}")
    figures = await audit(bootstrap, expected, args.drain_s)
    kills = [d for d in done if not d.startswith(FREEZE)]
    return {
        "jobs": len(expected),
        **figures,
        "kills": len(kills),
        "killed": [d.split("=", 1)[0] for d in kills],
        "leader_freezes": len(done) - len(kills),
        "planned": [f.target for f in plan],
        "executed": [d.split("=", 1)[0] for d in done],
    }


def chaos(
    rate: float,
    seconds: float,
    kill_every: float,
    seed: int,
    drain_s: float,
    keep: Path | None = None,
    freeze_share: int = 1,
) -> dict[str, Any]:
    """Start a stack of its own (600x time), run the chaos and return the audited figures.
    With `keep`, the stack's state (service logs under `logs/`) stays there to read after."""
    args = argparse.Namespace(
        rate=rate,
        seconds=seconds,
        kill_every=kill_every,
        seed=seed,
        drain_s=drain_s,
        freeze_share=freeze_share,
    )
    with contextlib.ExitStack() as scope:
        if keep is None:
            tmp = scope.enter_context(tempfile.TemporaryDirectory(prefix="qm-chaos-"))
        else:
            keep.mkdir(parents=True, exist_ok=True)
            tmp = str(keep)
        kafka = infra.start_kafka(Path(tmp) / "kafka")
        try:
            stack = Stack.start(
                Path(tmp) / "state",
                gateway_port=infra.free_port(),
                # The schedulers check their kept working set against a rebuild this often.
                # A deployment's partitions: each leader kill fences all of them.
                env={
                    "QM_KAFKA_BOOTSTRAP": kafka.url,
                    "QM_WORKING_SET_CHECK_EVERY": "25",
                    **REGISTRY_PARTITIONS,
                },
                # A fresh broker needs a fresh database: stored state would describe a
                # log that is gone (and executors would restore runs that no longer exist).
                reset_database=True,
                time_scale=600.0,
            )
            try:
                figures = asyncio.run(run(stack, kafka.url, args))
            finally:
                stack.stop()
            figures["working_set_drifts"] = len(drifted(Path(tmp) / "state" / "logs"))
            return figures
        finally:
            infra.stop(kafka)


def drifted(logs: Path) -> list[str]:
    """Every report in the schedulers' logs of a kept working set that differed from a rebuilt
    one (`services/scheduler/working.py`): none is expected."""
    return [
        f"{log.name}: {line.strip()[:300]}"
        for log in sorted(logs.glob("scheduler*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "working set drifted" in line
    ]


def summary(figures: dict[str, Any]) -> str:
    return (
        f"jobs {figures['jobs']}: terminal once {figures['terminal_once']}, lost "
        f"{figures['lost']}, duplicate effects {figures['duplicate_effects']}, "
        f"over-committed nodes {figures['double_allocations']}, wrong outcome "
        f"{figures['wrong_outcome']}; preemptions {figures['preemptions']} (checkpoints "
        f"{figures['checkpoints']}), failed runs retried or ended {figures['retries']}; "
        f"kills {figures['kills']} ({', '.join(sorted(set(figures['killed'])))}); "
        f"leader freezes {figures['leader_freezes']}; working set drifts "
        f"{figures.get('working_set_drifts', 0)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=40.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=6.0)
    parser.add_argument("--drain-s", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", type=Path, help="keep the stack's state and logs here")
    parser.add_argument(
        "--freeze-share",
        type=int,
        default=1,
        help="leader freezes per round of kills (1: one freeze per kill of each service)",
    )
    args = parser.parse_args()
    figures = chaos(
        args.rate,
        args.seconds,
        args.kill_every,
        args.seed,
        args.drain_s,
        args.keep,
        args.freeze_share,
    )
    print(summary(figures))
    for job_id, lines in figures.pop("samples").items():
        print(f"  {job_id}:", *lines, sep="\n    ")
    figures.pop("killed")
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
                    "freeze_share": args.freeze_share,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
