"""Runs with exact run times, the lifecycle events an executor and a scheduler would publish
for them, and the ground truth their metering must add up to. Shared by the meter's
integration tests; the examples/fleet.yaml node names and prices are used."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer

from schemas import topics
from schemas.envelope import Envelope
from schemas.events import (
    ClusterCapacity,
    JobFinished,
    JobPreempted,
    JobStarted,
    NodeInfo,
    PlacementDecided,
    PlacementRefused,
    ReplicaAssignment,
)
from schemas.job import JobSpec

# (cluster, accelerator type) -> (tier of its nodes in examples/fleet.yaml, price per hour)
FLEET_PRICES = {
    ("onprem-h100", "H100"): ("reserved", Decimal("2.10")),
    ("cloud-a100", "A100"): ("spot", Decimal("1.10")),
    ("cloud-a100", "L4"): ("on_demand", Decimal("0.70")),
    ("tpu-slices", "TPU-v5e"): ("on_demand", Decimal("1.20")),
}
NODE_PREFIX = {"H100": "h100", "A100": "a100", "L4": "l4", "TPU-v5e": "v5e"}


@dataclass(frozen=True)
class RunSpec:
    job_id: str
    tenant: str
    project: str
    cluster: str
    accelerator_type: str
    replicas: int
    per_replica: float
    ran_s: str  # exact, as the executor reports it (milliseconds)
    outcome: str = "succeeded"
    attempt: int = 1
    epoch: int = 1  # of the leader whose placement ran
    first_node: int = 0
    start_after_s: float = 0.0  # wall-clock delay from the scenario's start
    reason_code: str | None = None
    price: Decimal | None = None  # for clusters not in the fleet file
    node_names: tuple[str, ...] = ()

    @property
    def nodes(self) -> list[str]:
        if self.node_names:
            return list(self.node_names)
        prefix = NODE_PREFIX[self.accelerator_type]
        return [f"{self.cluster}-{prefix}-{self.first_node + i:04d}" for i in range(self.replicas)]

    @property
    def accelerator_seconds(self) -> Decimal:
        return Decimal(str(self.per_replica)) * self.replicas * Decimal(self.ran_s)

    @property
    def cost(self) -> Decimal:
        price = self.price or FLEET_PRICES[(self.cluster, self.accelerator_type)][1]
        return self.accelerator_seconds * price / 3600


def envelope(event_type: str, payload: object, producer: str, tenant: str) -> Envelope:
    body = payload.model_dump(mode="json", exclude_none=True)  # type: ignore[attr-defined]
    return Envelope(type=event_type, producer=producer, tenant=tenant, payload=body)


def placement(run: RunSpec, epoch: int | None = None, nodes: list[str] | None = None) -> Envelope:
    spec = JobSpec(
        job_id=run.job_id,
        tenant=run.tenant,
        project=run.project,
        user="ada",
        replicas=run.replicas,
        resources={"accelerators": run.per_replica},  # type: ignore[arg-type]
    )
    replicas = [
        ReplicaAssignment(replica=i, node_id=n, accelerators=run.per_replica, cpu=1, memory_gb=1)
        for i, n in enumerate(nodes or run.nodes)
    ]
    p = PlacementDecided(
        job_id=run.job_id,
        attempt=run.attempt,
        epoch=run.epoch if epoch is None else epoch,
        leader="test",
        cluster=run.cluster,
        accelerator_type=run.accelerator_type,
        replicas=replicas,
        spec=spec,
    )
    return envelope("PlacementDecided", p, "scheduler", run.tenant)


def refused(run: RunSpec, epoch: int) -> Envelope:
    p = PlacementRefused(
        job_id=run.job_id,
        attempt=run.attempt,
        epoch=epoch,
        cluster=run.cluster,
        reason_code="stale_epoch",
        message="test",
    )
    return envelope("PlacementRefused", p, f"executor/{run.cluster}", run.tenant)


def started(run: RunSpec, at: datetime) -> Envelope:
    p = JobStarted(
        job_id=run.job_id, attempt=run.attempt, cluster=run.cluster, nodes=run.nodes, started_at=at
    )
    return envelope("JobStarted", p, f"executor/{run.cluster}", run.tenant)


def finished(run: RunSpec, producer: str | None = None, ran_s: str | None = None) -> Envelope:
    p = JobFinished(
        job_id=run.job_id,
        attempt=run.attempt,
        outcome=run.outcome,  # type: ignore[arg-type]
        reason_code=run.reason_code,
        cluster=run.cluster,
        ran_s=float(ran_s if ran_s is not None else run.ran_s),
    )
    return envelope("JobFinished", p, producer or f"executor/{run.cluster}", run.tenant)


def preempted(run: RunSpec) -> Envelope:
    """The executor hands a run back (node failure, room for a higher claim)."""
    p = JobPreempted(
        job_id=run.job_id,
        attempt=run.attempt,
        cluster=run.cluster,
        reason_code=run.reason_code or "preempted",
        message="test",
        ran_s=float(run.ran_s),
    )
    return envelope("JobPreempted", p, f"executor/{run.cluster}", run.tenant)


def ended(run: RunSpec) -> Envelope:
    """How the run's end is announced: preempted runs on job.preempted, the rest finish."""
    return preempted(run) if run.outcome == "preempted" else finished(run)


def capacity(cluster: str, nodes: list[str], tier: str, price: float) -> Envelope:
    infos = [
        NodeInfo(
            node_id=n,
            block="b0",
            rack="r0",
            nvlink_domain=n,
            accelerator_type="H100",
            generation="hopper",
            accelerator_memory_gb=80,
            relative_speed=3,
            accelerators=8,
            cpu=64,
            memory_gb=512,
            price_tier=tier,
        )
        for n in nodes
    ]
    p = ClusterCapacity(
        cluster=cluster,
        location="test",
        kind="on_prem",
        prices={"H100": {tier: price}},
        nodes=infos,
    )
    return envelope("ClusterCapacity", p, f"executor/{cluster}", "")


TOPIC_OF = {
    "PlacementDecided": topics.PLACEMENT_DECIDED,
    "PlacementRefused": topics.PLACEMENT_REFUSED,
    "JobStarted": topics.JOB_STARTED,
    "JobFinished": topics.JOB_FINISHED,
    "JobPreempted": topics.JOB_PREEMPTED,
    "ClusterCapacity": topics.CLUSTER_CAPACITY,
}


async def send(producer: AIOKafkaProducer, *envelopes: Envelope, twice: bool = False) -> None:
    """Publish as the services would (keyed by job, or cluster); `twice` redelivers each."""
    futures = []
    for env in envelopes:
        key = env.payload.get("job_id") or env.payload.get("cluster")
        for _ in range(2 if twice else 1):
            futures.append(
                await producer.send(
                    TOPIC_OF[env.type], env.model_dump_json().encode(), key=str(key).encode()
                )
            )
    await asyncio.gather(*futures)


@dataclass
class Drive:
    """Plays runs in wall-clock time at `time_scale`: placement and start at their offset,
    the end when their run time is over. `hooks` run before a run's start (e.g. refusals)."""

    producer: AIOKafkaProducer
    time_scale: float
    twice: Callable[[RunSpec], bool] = lambda _run: False
    hooks: dict[str, Callable[[RunSpec], Awaitable[None]]] = field(default_factory=dict)

    async def one(self, run: RunSpec) -> None:
        await asyncio.sleep(run.start_after_s)
        if run.job_id in self.hooks:
            await self.hooks[run.job_id](run)
        at = datetime.now(UTC)
        await send(self.producer, placement(run), started(run, at), twice=self.twice(run))
        end = at.timestamp() + float(run.ran_s) / self.time_scale
        await asyncio.sleep(max(0.0, end - datetime.now(UTC).timestamp()))
        await send(self.producer, ended(run), twice=self.twice(run))

    async def all(self, runs: list[RunSpec]) -> None:
        await asyncio.gather(*(self.one(r) for r in runs))


def random_runs(tag: str, count: int, seed: int, spread_s: float) -> list[RunSpec]:
    """`count` runs on the example fleet with run times to the millisecond."""
    rng = random.Random(seed)
    shapes = [
        ("onprem-h100", "H100", 1, 8.0),
        ("onprem-h100", "H100", 2, 8.0),
        ("cloud-a100", "A100", 1, 4.0),
        ("cloud-a100", "L4", 1, 0.5),
        ("tpu-slices", "TPU-v5e", 4, 4.0),
    ]
    runs = []
    for i in range(count):
        cluster, acc, replicas, per = rng.choice(shapes)
        runs.append(
            RunSpec(
                job_id=f"{tag}-{i:03d}",
                tenant=rng.choice(["vision", "nlp", "speech"]) + f"-{tag}",
                project=rng.choice(["train", "eval"]),
                cluster=cluster,
                accelerator_type=acc,
                replicas=replicas,
                per_replica=per,
                ran_s=f"{rng.randint(100_000, 3_000_000) / 1000:.3f}",
                outcome=rng.choice(["succeeded", "succeeded", "failed", "canceled", "preempted"]),
                first_node=i * 4 % 16,
                start_after_s=rng.uniform(0, spread_s),
            )
        )
    return runs


def cents(value: Decimal) -> Decimal:
    return value.quantize(Decimal("0.01"))


# --- what the meter's ledger says about them ------------------------------------------------


async def ledger_by_run(pool: asyncpg.Pool, job_ids: list[str]) -> dict[str, Any]:
    rows = await pool.fetch(
        "SELECT run_id, sum(accelerator_seconds) AS s, sum(cost) AS c, sum(seconds) AS secs, "
        "count(*) FILTER (WHERE kind = 'close') AS closes FROM meter.usage "
        "WHERE job_id = ANY($1::text[]) GROUP BY run_id",
        job_ids,
    )
    return {r["run_id"]: r for r in rows}


async def until_closed(pool: asyncpg.Pool, runs: list[RunSpec], timeout_s: float = 60) -> None:
    want = {f"{r.job_id}#{r.attempt}" for r in runs}
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        got = await ledger_by_run(pool, [r.job_id for r in runs])
        if all(k in got and got[k]["closes"] >= 1 for k in want):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"runs not closed: {sorted(want - set(got))}")


def assert_exact(runs: list[RunSpec], by_run: dict[str, Any]) -> None:
    for r in runs:
        row = by_run[f"{r.job_id}#{r.attempt}"]
        assert row["secs"] == Decimal(r.ran_s), r  # fleet seconds, to the millisecond
        assert row["s"] == r.accelerator_seconds, r  # accelerator-seconds, exactly
        assert cents(row["c"]) == cents(r.cost), r  # cost, to the cent
        assert row["closes"] == 1, r
    total = sum((row["c"] for row in by_run.values()), Decimal(0))
    assert cents(total) == cents(sum((r.cost for r in runs), Decimal(0)))
