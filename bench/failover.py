"""Scheduler leader failover: the stack runs a leader and a standby; kill -9 the leader and time
until the standby leads (it holds the Redis lease and decides with a higher epoch), then start
the killed one again as the new standby for the next round.

Starts its own stack (or set QM_STATE_DIR to a running `qm up` state dir is NOT used: the
bench needs the process that started the stack, to add the standby and kill the leader).

    python bench/failover.py            # 3 rounds; prints each and the median
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe
from cli import infra
from cli.stack import REGISTRY_PARTITIONS, Service, Stack


def is_leader(service: Service) -> bool:
    try:
        text = httpx.get(f"http://127.0.0.1:{service.port}/metrics", timeout=1.0).text
    except httpx.HTTPError:
        return False
    return any(line.startswith("qm_scheduler_is_leader 1") for line in text.splitlines())


def wait_for_leader(services: list[Service], timeout_s: float = 30.0) -> Service | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for service in services:
            if service.running() and is_leader(service):
                return service
        time.sleep(0.02)
    return None


def fail_over(
    stack: Stack, schedulers: list[Service], timeout_s: float = 30.0
) -> tuple[float, Service | None]:
    """Kill -9 the current leader; seconds until another scheduler leads, and which."""
    leader = wait_for_leader(schedulers, timeout_s)
    if leader is None:
        raise RuntimeError("no scheduler leads")
    assert leader.pid is not None
    os.kill(leader.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    standby = wait_for_leader([s for s in schedulers if s is not leader], timeout_s)
    return time.monotonic() - killed_at, standby


def restart_killed(stack: Stack, schedulers: list[Service]) -> None:
    """Start the killed leader again: it rejoins as the standby."""
    for service in schedulers:
        if not service.running():
            stack.restart(service)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qm-failover-") as tmp:
        kafka = infra.start_kafka(Path(tmp) / "kafka")
        try:
            stack = Stack.start(
                Path(tmp) / "state",
                gateway_port=infra.free_port(),
                # A deployment's partitions: the new leader fences each of them.
                env={"QM_KAFKA_BOOTSTRAP": kafka.url, **REGISTRY_PARTITIONS},
                # A fresh broker needs a fresh database: stored state would describe a
                # log that is gone (and executors would restore runs that no longer exist).
                reset_database=True,
            )
            try:
                schedulers = [s for s in stack.services if s.module == "services.scheduler"]
                times = []
                for i in range(args.rounds):
                    took, leader = fail_over(stack, schedulers)
                    name = leader.name if leader else "nobody"
                    print(f"round {i + 1}: {name} leads {took:.2f} s after the leader was killed")
                    times.append(took)
                    restart_killed(stack, schedulers)
            finally:
                stack.stop()
        finally:
            infra.stop(kafka)
    median = statistics.median(times)
    print(f"failover: median {median:.2f} s over {len(times)} rounds (lease ttl 3 s)")
    print(
        json.dumps(
            {
                "bench": "failover",
                "failover_s": round(median, 2),
                "rounds_s": [round(t, 2) for t in times],
                "setup": {**describe(), "lease_ttl_ms": 3000, "rounds": len(times)},
            }
        )
    )


if __name__ == "__main__":
    main()
