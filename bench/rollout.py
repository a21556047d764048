"""Benchmark: inference services and robot fleets (issue 13).

1. Robots. A model version rolled out to 200 simulated robots in two sites, a tenth of them on
   flapping links (offline 30 % of every minute), in waves (canary 5 %, then waves of 25 %),
   each robot taking 5 s to install a version and each wave soaking 5 s: the time until 95 % of
   the robots run it, and whether a robot kept offline during the rollout gets it when it
   returns (and how long that takes).
2. Scaling. A service of 1-6 replicas (10 requests/s each, a 5 s model load) whose load steps
   from 6 to 60 requests/s, reported per replica as a router would: the time from the step
   until 6 replicas serve, three times (the load falls back in between).
   Both run on a stack started here, in real time (time scale 1), with its own fleet file; or
   on the running stack when QM_GATEWAY_URL and QM_KAFKA_BOOTSTRAP are set (its own robots).
3. The price of guaranteed minimums. In the simulator (the scheduling core), a week of the
   Philly trace on 64 x 8 GPUs, with and without 8 services of 4 guaranteed one-GPU replicas
   (class `high`, not preemptible) arriving on the second day: the batch GPU-hours served while
   the services run, the batch preemptions they cause, and the batch JCT. Skipped with a
   message when the trace is absent.

    .venv/bin/python bench/rollout.py

Ends with one JSON line (shared BENCH.md, key `rollout`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe
from schemas import topics
from schemas.serving import ReplicaReported
from services.common.kafka import OutMessage, envelope_for

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "philly.csv"
TOKEN = {"Authorization": "Bearer dev-vision"}
ROBOTS = 200
FLAPPING = 0.1
MODEL = "bench-nav"


def fleet_doc() -> dict[str, Any]:
    return {
        "clusters": [
            {
                "name": "gpu",
                "location": "us-east-dc1",
                "kind": "on_prem",
                "prices": {"L4": {"reserved": 0.35}},
                "node_groups": [
                    {
                        "prefix": "l4",
                        "count": 8,
                        "accelerator_type": "L4",
                        "accelerators_per_node": 4,
                        "cpu": 48,
                        "memory_gb": 192,
                        "price_tier": "reserved",
                    }
                ],
            }
        ],
        "robot_fleets": [
            {
                "name": "bench-robots",
                "kind": "edge",
                "flap_period_s": 60,
                "offline_share": 0.3,
                "install_s": 5,
                "sites": [
                    {
                        "site": "plant-a",
                        "count": ROBOTS // 2,
                        "accelerator_type": "Jetson-Orin",
                        "flaky_share": FLAPPING,
                    },
                    {
                        "site": "plant-b",
                        "count": ROBOTS - ROBOTS // 2,
                        "accelerator_type": "Jetson-Orin",
                        "flaky_share": FLAPPING,
                    },
                ],
            }
        ],
    }


@contextlib.contextmanager
def platform() -> Iterator[tuple[str, str, str, Any]]:
    """(gateway, kafka, where, stack or None)."""
    if os.environ.get("QM_GATEWAY_URL") and os.environ.get("QM_KAFKA_BOOTSTRAP"):
        yield os.environ["QM_GATEWAY_URL"], os.environ["QM_KAFKA_BOOTSTRAP"], "running stack", None
        return
    from cli import infra
    from cli.stack import Stack

    with tempfile.TemporaryDirectory(prefix="qm-bench-") as tmp:
        fleet = Path(tmp) / "fleet.yaml"
        fleet.write_text(yaml.safe_dump(fleet_doc()))
        kafka = infra.start_kafka(Path(tmp) / "kafka")
        env = {"QM_KAFKA_BOOTSTRAP": kafka.url}
        try:
            stack = Stack.start(
                Path(tmp) / "state",
                gateway_port=infra.free_port(),
                env=env,
                fleet_file=fleet,
                time_scale=1.0,
                reset_database=True,
            )
            try:
                yield stack.gateway_url, kafka.url, "stack started by the bench", stack
            finally:
                stack.stop()
        finally:
            infra.stop(kafka)


async def wait_for(
    client: httpx.AsyncClient, path: str, done: Any, timeout_s: float, every_s: float = 0.25
) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    body: dict[str, Any] = {}
    while time.monotonic() - started < timeout_s:
        r = await client.get(path, headers=TOKEN)
        if r.status_code == 200:
            body = r.json()
            if done(body):
                return body, time.monotonic() - started
        await asyncio.sleep(every_s)
    raise TimeoutError(f"{path}: not there after {timeout_s:g} s: {str(body)[:500]}")


def on(body: dict[str, Any], version: str) -> set[str]:
    return {r["robot"] for r in body["robots"] if r["running"].get(MODEL) == version}


async def robots_part(client: httpx.AsyncClient, stack: Any) -> dict[str, Any]:
    inventory, _ = await wait_for(client, "/v1/robots", lambda b: b["total"] > 0, 60)
    everyone = {r["robot"] for r in inventory["robots"]}
    clusters = {r["cluster"] for r in inventory["robots"]}
    edge = None
    if stack is not None:
        edge = next(s for s in stack.services if s.extra_env.get("QM_EDGE_FLEET"))
    # A steady robot kept offline for the whole rollout.
    away = sorted(everyone)[3]
    figures: dict[str, Any] = {"robots": len(everyone), "robot_fleets": sorted(clusters)}
    if edge is not None:
        await client.post(
            f"http://127.0.0.1:{edge.port}/faults/robot", json={"robot": away, "link": "offline"}
        )
    version = f"v{int(time.time())}"
    body = {
        "name": MODEL,
        "model": MODEL,
        "version": version,
        "to": {},
        "canary_share": 0.05,
        "wave_share": 0.25,
        "soak_s": 5,
    }
    started = time.monotonic()
    r = await client.post("/v1/deployments", json=body, headers=TOKEN)
    r.raise_for_status()
    need = int(0.95 * len(everyone) + 0.999)
    marks: dict[str, float] = {}
    while time.monotonic() - started < 600:
        seen = (await client.get("/v1/robots", headers=TOKEN)).json()
        count = len(on(seen, version))
        for share in (0.5, 0.9, 0.95):
            if count >= share * len(everyone) and f"{share:.0%}" not in marks:
                marks[f"{share:.0%}"] = time.monotonic() - started
        if count >= need:
            break
        await asyncio.sleep(0.25)
    figures["rollout_95_s"] = round(marks.get("95%", float("nan")), 2)
    figures["rollout_marks_s"] = {k: round(v, 2) for k, v in marks.items()}
    view, _ = await wait_for(
        client, f"/v1/deployments/{MODEL}", lambda b: b["status"]["phase"] == "done", 600
    )
    figures["rollout_done_s"] = round(time.monotonic() - started, 2)
    figures["waves"] = view["status"]["waves"]
    print(
        f"robots: {len(everyone)} ({FLAPPING:.0%} flapping), {figures['waves']} waves; "
        f"50/90/95 % on the new version after "
        + " / ".join(f"{v:.1f}" for v in marks.values())
        + f" s; done after {figures['rollout_done_s']:.1f} s"
    )
    if edge is not None:
        back = time.monotonic()
        await client.post(
            f"http://127.0.0.1:{edge.port}/faults/robot", json={"robot": away, "link": "online"}
        )
        try:
            _, took = await wait_for(client, "/v1/robots", lambda b: away in on(b, version), 60)
            figures["offline_converged"] = True
            figures["offline_converge_s"] = round(time.monotonic() - back, 2)
            print(f"robot {away}, offline through the rollout, ran it {took:.1f} s after returning")
        except TimeoutError:
            figures["offline_converged"] = False
            print(f"robot {away}, offline through the rollout, never caught up")
    else:
        figures["offline_converged"] = None
    return figures


@contextlib.asynccontextmanager
async def router(
    client: httpx.AsyncClient, kafka: str, name: str, offered: list[float]
) -> AsyncIterator[None]:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=kafka)
    await producer.start()

    async def loop() -> None:
        while True:
            r = await client.get(f"/v1/services/{name}/endpoints", headers=TOKEN)
            endpoints = r.json()["endpoints"] if r.status_code == 200 else []
            share = offered[0] / max(len(endpoints), 1)
            for e in endpoints:
                report = ReplicaReported(
                    service=name, replica=e["replica"], rps=share, latency_ms=40.0
                )
                message = OutMessage(
                    topics.SERVICE_LOAD,
                    name,
                    envelope_for("ReplicaReported", report, producer="bench-router"),
                )
                await producer.send(topics.SERVICE_LOAD, message.encode(), key=name.encode())
            await asyncio.sleep(0.5)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await producer.stop()


def serving(count: int) -> Any:
    def check(b: dict[str, Any]) -> bool:
        s = b["status"]
        return s["desired_replicas"] == count and len(s["endpoints"]) == count

    return check


async def scaling_part(client: httpx.AsyncClient, kafka: str, time_scale: float) -> dict[str, Any]:
    name = f"bench-chat-{int(time.time()) % 100000}"
    spec = {
        "name": name,
        "model": "chat",
        "version": "v1",
        "resources": {"accelerators": 1, "accelerator_types": ["L4"], "cpu": 4, "memory_gb": 16},
        "min_replicas": 1,
        "max_replicas": 6,
        "target_rps": 10,
        "latency_slo_ms": 300,
        "scale_down_after_s": 10 * time_scale,
        "labels": {"sim_ready_after_s": str(5 * time_scale)},
        "priority_class": "high",
    }
    r = await client.post("/v1/services", json=spec, headers=TOKEN)
    r.raise_for_status()
    path = f"/v1/services/{name}"
    await wait_for(client, path, serving(1), 120)
    # 6 requests/s needs one replica, with the 80 % headroom a scale-down keeps.
    offered = [6.0]
    ups: list[float] = []
    async with router(client, kafka, name, offered):
        for _ in range(3):
            offered[0] = 60.0
            _, took = await wait_for(client, path, serving(6), 180, every_s=0.1)
            ups.append(took)
            offered[0] = 6.0
            await wait_for(client, path, serving(1), 180)
    await client.delete(path, headers=TOKEN)
    print(
        "scaling: 6 -> 60 requests/s, 1 -> 6 replicas serving after "
        + ", ".join(f"{t:.1f}" for t in ups)
        + " s (a 5 s model load each)"
    )
    return {"scale_response_s": round(statistics.median(ups), 2), "scale_responses_s": ups}


def guaranteed_cost() -> dict[str, Any]:
    """Batch GPU-hours the services' guaranteed minimums cost, in the simulator."""
    if not TRACE.is_file():
        print(f"price of guaranteed minimums: skipped, {TRACE} is absent")
        return {}
    from core.model import JobId, JobRequest, TenantId, TopologyLevel, WorkloadKind
    from services.common.policyfile import load_policy
    from sim.engine import Simulation
    from sim.fleet import pool_fleet
    from sim.report import summarize
    from sim.workload import SimJob, Window, load_philly

    policy = load_policy(ROOT / "examples" / "policy.yaml")
    batch = load_philly(TRACE, Window.parse("2017-10-01:2017-10-07"))
    first = min(j.request.submit_time for j in batch)
    start, end = first + 86400, first + 7 * 86400
    services = [
        SimJob(
            JobRequest(
                job_id=JobId(f"svc-{s}-{r}"),
                tenant=TenantId("inference"),
                project="serving",
                user="serving",
                queue="default",
                priority_class="high",
                kind=WorkloadKind.INFERENCE_SERVICE,
                replicas=1,
                accelerators=1.0,
                accelerator_types=(),
                accelerator_memory_gb=None,
                cpu=4.0,
                memory_gb=16.0,
                topology=TopologyLevel.NODE,
                topology_required=False,
                preemptible=False,
                submit_time=start,
                spread_group=f"svc-{s}",  # as the scheduler sees a service's replicas
            ),
            end - start,
        )
        for s in range(8)
        for r in range(4)
    ]
    results = {}
    for label, jobs in (("batch only", batch), ("with services", batch + services)):
        clusters, nodes = pool_fleet("64x8", policy)
        sim = Simulation(clusters, nodes, policy, jobs, 60.0)
        records = sim.run()
        hours = range(int(start // 3600), int(end // 3600))
        busy = sum(sim.trace.hourly_busy.get(h, 0.0) for h in hours) / 3600
        svc_busy = (
            sum(
                (min(r.finish or end, end) - max(r.first_start or end, start)) * 1.0
                for r in records.values()
                if r.job.request.kind is WorkloadKind.INFERENCE_SERVICE
                and r.first_start is not None
            )
            / 3600
        )
        batch_records = {
            k: v
            for k, v in records.items()
            if v.job.request.kind is not WorkloadKind.INFERENCE_SERVICE
        }
        s = summarize(batch_records, sim.trace)
        results[label] = {
            "batch_gpu_hours": busy - svc_busy,
            "service_gpu_hours": svc_busy,
            "avg_batch_jct_s": s["avg_jct_s"],
            "preemptions": sim.trace.preemptions,
            "lost_work_gpu_hours": sim.trace.lost_work / 3600,
        }
    base, svc = results["batch only"], results["with services"]
    cost = base["batch_gpu_hours"] - svc["batch_gpu_hours"]
    print(
        f"guaranteed minimums (8 services x 4 GPUs, {svc['service_gpu_hours']:.0f} GPU-hours "
        f"over 6 days on 512 GPUs): batch served {base['batch_gpu_hours']:.0f} -> "
        f"{svc['batch_gpu_hours']:.0f} GPU-hours ({cost:.0f} fewer), batch preemptions "
        f"{base['preemptions']} -> {svc['preemptions']} (lost work "
        f"{svc['lost_work_gpu_hours']:.0f} GPU-hours), batch avg JCT "
        f"{base['avg_batch_jct_s']:.0f} -> {svc['avg_batch_jct_s']:.0f} s"
    )
    return {
        "guaranteed_batch_gpu_hours_cost": round(cost, 1),
        "guaranteed_service_gpu_hours": round(svc["service_gpu_hours"], 1),
        "guaranteed_batch_preemptions": svc["preemptions"] - base["preemptions"],
        "guaranteed_batch_jct_ratio": round(svc["avg_batch_jct_s"] / base["avg_batch_jct_s"], 3),
    }


async def live(gateway: str, kafka: str, stack: Any) -> dict[str, Any]:
    time_scale = 1.0 if stack is not None else float(os.environ.get("QM_TIME_SCALE", "60"))
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
        figures = await robots_part(client, stack)
        figures |= await scaling_part(client, kafka, time_scale)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--part",
        choices=("all", "live", "sim"),
        default="all",
        help="live: robots and scaling on a stack; sim: the price of guaranteed minimums",
    )
    args = parser.parse_args()
    started = time.monotonic()
    figures: dict[str, Any] = {}
    if args.part in ("all", "live"):
        with platform() as (gateway, kafka, where, stack):
            print(f"rollout against the {where} ({gateway})")
            figures = asyncio.run(live(gateway, kafka, stack))
    if args.part in ("all", "sim"):
        figures |= guaranteed_cost()
    setup = {
        **describe(),
        "time_scale": 1.0,
        "flapping_share": FLAPPING,
        "install_s": 5,
        "soak_s": 5,
        "canary_share": 0.05,
        "wave_share": 0.25,
        "wall_s": round(time.monotonic() - started, 1),
        "part": args.part,
    }
    print(
        json.dumps(
            {"bench": "rollout", **figures, "flapping_share": FLAPPING, "setup": setup},
            default=str,
        )
    )


if __name__ == "__main__":
    main()
