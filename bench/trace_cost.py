"""What tracing costs per message at one hop (docs/tracing.md): what a consumer does for each
record of a batch (read the trace context, open the job's span, stamp what it caused, put the
header on the wire, end the span), with tracing off, on for traced records, and on for records
that carry no context at a hop that does not start traces. Export (JSON lines through the batch
processor's thread) is counted in the CPU figure, not in the event loop's.

    python bench/trace_cost.py             # 20,000 records per round, 5 rounds

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import describe
from schemas.envelope import Envelope
from services.common.kafka import OutMessage, envelope_for
from services.common.settings import ServiceSettings
from services.common.tracing import Tracing, hops, incoming

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
BATCH = 500


def records(n: int, traced: bool) -> list[tuple[list[tuple[str, bytes]], Envelope]]:
    headers = [("type", b"PlacementDecided")]
    if traced:
        headers.append(("traceparent", PARENT.encode()))
    return [(headers, Envelope(type="PlacementDecided")) for _ in range(n)]


def hop_round(tracing: Tracing | None, batch: list[Any]) -> None:
    """One batch as the executor's step handles it, minus the store."""
    traced = hops(tracing, "executor.start")
    with traced:
        for i, (headers, env) in enumerate(batch):
            traced.open(env.event_id, incoming(headers, env), job_id=f"job-{i}", attempt=1)
        out = [
            OutMessage(
                "job.started", f"job-{i}", envelope_for("JobStarted", {}, producer="x", cause=env)
            )
            for i, (_, env) in enumerate(batch)
        ]
        traced.stamp(out)
        for message in out:
            message.wire()


def measure(tracing: Tracing | None, traced: bool, n: int) -> tuple[float, float]:
    """(event-loop µs per record, CPU µs per record including export)."""
    data = records(n, traced)
    cpu = time.process_time()
    wall = time.perf_counter()
    for start in range(0, n, BATCH):
        hop_round(tracing, data[start : start + BATCH])
    loop_s = time.perf_counter() - wall
    if tracing is not None:
        tracing.provider.force_flush()
    cpu_s = time.process_time() - cpu
    return loop_s / n * 1e6, cpu_s / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ways = ("off", "on_traced", "on_untraced")
    loop: dict[str, list[float]] = {w: [] for w in ways}
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory(prefix="qm-trace-cost-") as tmp:
        tracing = Tracing.configure("executor/bench", ServiceSettings(trace_dir=tmp))
        assert tracing is not None
        for _ in range(args.rounds):  # alternating, so drift hits every way alike
            for way in ways:
                on = None if way == "off" else tracing
                at_loop, at_cpu = measure(on, way == "on_traced", args.records)
                loop[way].append(at_loop)
                cpu[way].append(at_cpu)
        tracing.shutdown()
        written = sum(p.stat().st_size for p in Path(tmp).glob("*.jsonl*"))
    med = {w: round(statistics.median(v), 2) for w, v in loop.items()}
    med_cpu = {w: round(statistics.median(v), 2) for w, v in cpu.items()}
    print(
        json.dumps(
            {
                "bench": "trace_cost",
                "loop_us_per_record": med,
                "cpu_us_per_record": med_cpu,
                "added_loop_us_traced": round(med["on_traced"] - med["off"], 2),
                "added_cpu_us_traced": round(med_cpu["on_traced"] - med_cpu["off"], 2),
                "span_bytes": round(written / (args.records * args.rounds)),
                "setup": {
                    **describe(),
                    "records_per_round": args.records,
                    "rounds": args.rounds,
                    "batch": BATCH,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
