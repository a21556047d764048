"""CPU per record of a consumer's decoding (`decode_payloads`: envelope and payload in one pass
where schemas.registry.parse_typed applies), by batch size, with Python's cyclic garbage
collector as a service starts with and with its start-up heap frozen
(services.common.runtime.freeze_heap), next to the usual way (the envelope with its payload as
a dict, then the payload validated by topic) for comparison.

    python bench/decode_cost.py              # 1,000-record and 20-record batches, 3 rounds

Each round decodes the same `job.queued` records (a 2-replica, 8-accelerator job, as the queue
writes them) with the gateway's topic models. The heap is first grown to a service's size by
importing what the gateway imports. Rounds alternate the two GC settings (unfreezing in
between), so both are measured under the same conditions.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokafka import ConsumerRecord

import services.gateway.app  # noqa: F401  (a service's heap: what the gateway imports)
from schemas import topics
from schemas.events import JobQueued
from schemas.job import JobSpec
from services.common.deadletter import decode_envelopes, decode_payloads
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


def one_pass(batch: tuple[ConsumerRecord[Any, Any], ...]) -> int:
    decoded, dead = decode_payloads(batch, PROJECTED, consumer="bench")
    assert not dead and all(not isinstance(got.envelope.payload, dict) for got, _ in decoded)
    return len(decoded)


def usual(batch: tuple[ConsumerRecord[Any, Any], ...]) -> int:
    """The usual way: what `decode_payloads` does with a record the one pass does not take."""
    received, dead = decode_envelopes(batch, consumer="bench")
    assert not dead
    decoded = [
        (got, PROJECTED[got.record.topic].model_validate(got.envelope.payload)) for got in received
    ]
    return len(decoded)


WAYS: dict[str, Callable[[tuple[ConsumerRecord[Any, Any], ...]], int]] = {
    "decode_payloads": one_pass,
    "usual_way": usual,
}


def per_record_us(
    decode: Callable[[tuple[ConsumerRecord[Any, Any], ...]], int],
    batch: tuple[ConsumerRecord[Any, Any], ...],
    total: int,
) -> float:
    rounds = max(1, total // len(batch))
    start = time.process_time()
    for _ in range(rounds):
        assert decode(batch) == len(batch)
    return (time.process_time() - start) / (rounds * len(batch)) * 1e6


def main() -> None:
    records = tuple(record(i) for i in range(RECORDS))
    sizes = {"batch_1000": records, "batch_20": records[:20]}
    results: dict[str, list[float]] = {}
    tracked = len(gc.get_objects())
    for _ in range(3):
        for mode in ("default", "frozen"):
            for way, decode in WAYS.items():
                gc.unfreeze()
                gc.collect()
                if mode == "frozen":
                    freeze_heap()
                for name, batch in sizes.items():
                    key = (
                        f"{mode}_{name}_us"
                        if way == "decode_payloads"
                        else f"{way}_{mode}_{name}_us"
                    )
                    results.setdefault(key, []).append(per_record_us(decode, batch, 5 * RECORDS))
        gc.unfreeze()
    print(f"heap: {tracked} objects tracked by the collector before freezing")
    figures: dict[str, float] = {}
    for key, values in results.items():
        median = statistics.median(values)
        figures[key] = round(median, 1)
        shown = ", ".join(f"{v:.1f}" for v in values)
        way = "the usual way  " if key.startswith("usual_way") else "decode_payloads"
        label = key.removeprefix("usual_way_").removesuffix("_us").replace("_batch_", ", batch ")
        print(f"{way}, gc {label:20s}: median {median:5.1f} us/record ({shown})")
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
