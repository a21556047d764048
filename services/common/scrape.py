"""Reading the services' own /metrics (the gateway's scheduler health page, the health
service's SLO evaluator): each target's samples, fetched concurrently with a short timeout, so
one slow or dead service shows as such and the reader still answers."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

FETCH_TIMEOUT_S = 1.5


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Target:
    name: str
    url: str
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None

    def values(self, name: str, **labels: str) -> list[Sample]:
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def total(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.values(name, **labels) if math.isfinite(s.value))


def parse_targets(raw: str) -> list[tuple[str, str]]:
    """`name=url,name=url` (QM_METRICS_TARGETS); entries without a name are named by URL."""
    out = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, url = part.partition("=")
        out.append((name.strip(), url.strip()) if sep else (part, part))
    return out


def parse_metrics(text: str) -> list[Sample]:
    samples = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.append(Sample(s.name, dict(s.labels), float(s.value)))
    return samples


async def scrape(targets: Iterable[tuple[str, str]]) -> list[Target]:
    async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S) as client:

        async def one(name: str, url: str) -> Target:
            target = Target(name, url)
            try:
                answer = await client.get(url)
                answer.raise_for_status()
                target.samples = parse_metrics(answer.text)
            except (httpx.HTTPError, ValueError) as exc:
                target.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return target

        return list(await asyncio.gather(*(one(n, u) for n, u in targets)))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a cumulative Prometheus histogram [(le, count)], interpolated
    linearly within the bucket it falls in (as PromQL's histogram_quantile does)."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le


def histogram(target: Target, name: str, **labels: str) -> dict[str, float | None]:
    """count, mean, p50, p99 of a histogram, summed over its other labels."""
    by_le: dict[float, float] = {}
    for s in target.values(f"{name}_bucket", **labels):
        le = float(s.labels.get("le", "inf"))
        by_le[le] = by_le.get(le, 0.0) + s.value
    count = target.total(f"{name}_count", **labels)
    total = target.total(f"{name}_sum", **labels)
    buckets = list(by_le.items())
    return {
        "count": count,
        "mean": total / count if count else None,
        "p50": histogram_quantile(0.5, buckets),
        "p99": histogram_quantile(0.99, buckets),
    }
