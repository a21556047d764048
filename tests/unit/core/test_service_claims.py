"""A service's guaranteed replicas (class `high`, not preemptible, as the serving service
submits them) take room from batch work when the fleet is full, and batch work of any class
never takes it back; replicas above the minimum (preemptible) can be preempted."""

from __future__ import annotations

import dataclasses
import random

from cli.stack import PROJECT_ROOT
from core.cycle import CycleResult, schedule
from core.model import JobRequest, WorkloadKind
from services.common.policyfile import load_policy
from tests.unit.core.builders import gpu_nodes, job, running, snapshot

POLICY = load_policy(PROJECT_ROOT / "examples" / "policy.yaml")


def replica(n: int, guaranteed: bool) -> JobRequest:
    j = job(
        1,
        job_id=f"svc-chat-{n}",
        kind=WorkloadKind.INFERENCE_SERVICE,
        priority="high",
        preemptible=not guaranteed,
        submit=50.0,
    )
    return dataclasses.replace(j, spread_group="vision/chat")


def victims(result: CycleResult) -> list[str]:
    return [v.job_id for p in result.preemptions for v in p.victims]


def run(snap: object) -> CycleResult:
    return schedule(snap, POLICY, now=10_000.0, rng=random.Random(0))  # type: ignore[arg-type]


def test_a_guaranteed_replica_preempts_batch_work_on_a_full_fleet() -> None:
    nodes = gpu_nodes(2)
    batch = [running(job(8, job_id=f"batch{i}", tenant="nlp"), f"c1-n-000{i}") for i in range(2)]
    result = run(snapshot(nodes, [replica(1, guaranteed=True)], batch))
    assert victims(result) in (["batch0"], ["batch1"]), result
    assert result.preemptions[0].for_job == "svc-chat-1"


def test_batch_work_never_preempts_a_guaranteed_replica() -> None:
    nodes = gpu_nodes(1, gpus=1)
    held = [running(replica(1, guaranteed=True), "c1-n-0000")]
    urgent = job(1, job_id="urgent", tenant="nlp", priority="critical", submit=60.0)
    result = run(snapshot(nodes, [urgent], held))
    assert result.preemptions == () and result.placements == ()


def test_a_replica_above_the_minimum_can_be_preempted_by_a_higher_claim() -> None:
    nodes = gpu_nodes(1, gpus=1)
    held = [running(replica(2, guaranteed=False), "c1-n-0000")]
    urgent = job(1, job_id="urgent", tenant="nlp", priority="critical", submit=60.0)
    result = run(snapshot(nodes, [urgent], held))
    assert victims(result) == ["svc-chat-2"], result
