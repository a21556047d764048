"""CPU per record of a consumer's decoding (envelope, then the payload by topic), by batch size,
with Python's cyclic garbage collector as a service starts with and with its start-up heap
frozen (services.common.runtime.freeze_heap), next to a one-pass typed parse for comparison.

    python bench/decode_cost.py              # 1,000-record and 20-record batches, 3 rounds

Each round decodes the same `job.queued` records (a 2-replica, 8-accelerator job, as the queue
writes them) with `decode_payloads` and the gateway's topic models. The heap is first grown to
a service's size by importing what the gateway imports. Rounds alternate the two GC settings
(unfreezing in between), so both are measured under the same conditions.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokafka import ConsumerRecord

import services.gateway.app  # noqa: F401  (a service's heap: what the gateway imports)
from schemas import topics
from schemas.envelope import Envelope
from schemas.events import JobQueued
from schemas.job import JobSpec
from services.common.deadletter import decode_payloads
from services.common.kafka import envelope_for
from services.common.runtime import freeze_heap
from services.gateway.handlers import PROJECTED

RECORDS = 1000


def record(offset: int) -> ConsumerRecord[Any, Any]:
    job_id = f"j-{offset}"
    spec = JobSpec.model_validate(
        {
            "job_id": job_id,
            "tenant": "vision",
            "replicas": 2,
            "resources": {"accelerators": 8, "cpu": 16, "memory_gb": 64},
        }
    )
    queued = JobQueued(job_id=job_id, spec=spec, submitted_at=datetime.now(UTC), attempt=0)
    raw = envelope_for("JobQueued", queued, producer="queue", tenant="vision").model_dump_json()
    value = raw.encode()
    return ConsumerRecord(
        topic=topics.JOB_QUEUED,
        partition=0,
        offset=offset,
        timestamp=0,
        timestamp_type=0,
        key=job_id.encode(),
        value=value,
        checksum=None,
        serialized_key_size=len(job_id),
        serialized_value_size=len(value),
        headers=(),
    )


class TypedQueued(Envelope):
    payload: JobQueued  # type: ignore[assignment]


def per_record_us(batch: tuple[ConsumerRecord[Any, Any], ...], total: int) -> float:
    rounds = max(1, total // len(batch))
    start = time.process_time()
    for _ in range(rounds):
        decoded, dead = decode_payloads(batch, PROJECTED, consumer="bench")
        assert len(decoded) == len(batch) and not dead
    return (time.process_time() - start) / (rounds * len(batch)) * 1e6


def typed_us(batch: tuple[ConsumerRecord[Any, Any], ...]) -> float:
    start = time.process_time()
    for r in batch:
        TypedQueued.model_validate_json(r.value)
    return (time.process_time() - start) / len(batch) * 1e6


def main() -> None:
    records = tuple(record(i) for i in range(RECORDS))
    sizes = {"batch_1000": records, "batch_20": records[:20]}
    results: dict[str, dict[str, list[float]]] = {
        mode: {name: [] for name in sizes} for mode in ("default", "frozen")
    }
    typed: list[float] = []
    tracked = len(gc.get_objects())
    for _ in range(3):
        for mode in ("default", "frozen"):
            gc.unfreeze()
            gc.collect()
            if mode == "frozen":
                freeze_heap()
            for name, batch in sizes.items():
                results[mode][name].append(per_record_us(batch, 5 * RECORDS))
        gc.unfreeze()
        typed.append(typed_us(records))
    print(f"heap: {tracked} objects tracked by the collector before freezing")
    figures: dict[str, float] = {}
    for mode, per_size in results.items():
        for name, values in per_size.items():
            median = statistics.median(values)
            figures[f"{mode}_{name}_us"] = round(median, 1)
            shown = ", ".join(f"{v:.1f}" for v in values)
            label = f"decode_payloads, gc {mode:7s} {name:10s}"
            print(f"{label}: median {median:5.1f} us/record ({shown})")
    figures["typed_one_pass_us"] = round(statistics.median(typed), 1)
    print(
        f"one typed parse (envelope and JobQueued in one model): {figures['typed_one_pass_us']} us"
    )
    print(
        json.dumps(
            {
                "bench": "decode_cost",
                **figures,
                "setup": {
                    "cores": os.cpu_count(),
                    "records": RECORDS,
                    "record_bytes": len(records[0].value),
                    "heap_objects": tracked,
                    "python": platform.python_version(),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
