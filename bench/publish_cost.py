"""CPU per message published: FastStream's publish path against the direct producer send the
services use (services.common.kafka.send), same broker, same message, alternating rounds.

    python bench/publish_cost.py            # 5,000 messages per round, 3 rounds

Starts its own broker unless QM_KAFKA_BOOTSTRAP is set. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe
from services.common.kafka import make_broker, send
from services.common.settings import ServiceSettings

TOPIC = "job.started"


@contextmanager
def broker_url() -> Iterator[str]:
    if os.environ.get("QM_KAFKA_BOOTSTRAP"):
        yield os.environ["QM_KAFKA_BOOTSTRAP"]
        return
    from cli import infra

    with tempfile.TemporaryDirectory(prefix="qm-publish-") as tmp:
        kafka = infra.start_kafka(Path(tmp) / "kafka")
        try:
            yield kafka.url
        finally:
            infra.stop(kafka)


async def measure(url: str, messages: int, rounds: int) -> dict[str, list[float]]:
    # The services' broker, Prometheus middleware included.
    broker = make_broker(ServiceSettings(kafka_bootstrap=url), "publish-cost", CollectorRegistry())
    await broker.connect()
    body = json.dumps({"type": "JobStarted", "payload": {"job_id": "x" * 40, "pad": "y" * 500}})
    value = body.encode()
    out: dict[str, list[float]] = {"faststream": [], "direct": []}
    try:
        for _ in range(rounds):
            for way in out:
                started = time.process_time()
                pending: list[Any] = []
                for i in range(messages):
                    key = f"job-{i}"
                    if way == "direct":
                        fut = await send(broker, value, TOPIC, key, (("type", "JobStarted"),))
                    else:
                        fut = await broker.publish(
                            value,
                            TOPIC,
                            key=key.encode(),
                            headers={"type": "JobStarted"},
                            no_confirm=True,
                        )
                    pending.append(fut)
                await asyncio.gather(*pending)
                out[way].append((time.process_time() - started) / messages * 1e6)
    finally:
        await broker.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with broker_url() as url:
        per = asyncio.run(measure(url, args.messages, args.rounds))
    med = {way: round(statistics.median(v), 1) for way, v in per.items()}
    for way, values in per.items():
        print(f"{way}: {', '.join(f'{v:.1f}' for v in values)} µs CPU per message")
    ratio = med["faststream"] / med["direct"]
    print(f"median: FastStream {med['faststream']} µs, direct {med['direct']} µs ({ratio:.1f}x)")
    setup = {**describe(), "messages": args.messages, "rounds": args.rounds, "bytes": 560}
    print(
        json.dumps(
            {
                "bench": "publish_cost",
                "cpu_us_per_msg": med,
                "ratio": round(ratio, 2),
                "setup": setup,
            }
        )
    )


if __name__ == "__main__":
    main()
