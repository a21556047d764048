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

FETCH_TIMEOUT_S = 1.5  # the whole fetch, not each read: a trickling target is cut off
MAX_BODY_BYTES = 4 * 1024 * 1024  # a /metrics page larger than this is refused, not buffered


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
    """Samples of a Prometheus text page; a malformed page raises ValueError."""
    samples = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.append(Sample(s.name, dict(s.labels), float(s.value)))
    return samples


def scrape_client() -> httpx.AsyncClient:
    """A client for repeated scrapes. Making one loads the CA bundle into a new TLS context
    (50-80 ms of CPU on a two-core machine; 17% of the health service's CPU in a profile at
    200 jobs/s), so a process that scrapes on a timer keeps one."""
    return httpx.AsyncClient(timeout=FETCH_TIMEOUT_S)


async def scrape(
    targets: Iterable[tuple[str, str]], client: httpx.AsyncClient | None = None
) -> list[Target]:
    """Every target's samples, or why not. `client`: a kept one (scrape_client); else one is
    made for this call."""
    if client is None:
        async with scrape_client() as own:
            return await scrape(targets, own)

    async def one(name: str, url: str) -> Target:
        target = Target(name, url)
        try:
            async with asyncio.timeout(FETCH_TIMEOUT_S):
                body = await _body(client, url)
            target.samples = parse_metrics(body.decode("utf-8", errors="replace"))
        except TimeoutError:
            target.error = f"no answer within {FETCH_TIMEOUT_S:g} s"
        except (httpx.HTTPError, ValueError, TooLarge) as exc:
            target.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return target

    return list(await asyncio.gather(*(one(n, u) for n, u in targets)))


class TooLarge(Exception):
    """A /metrics page over MAX_BODY_BYTES."""


async def _body(client: httpx.AsyncClient, url: str) -> bytes:
    async with client.stream("GET", url) as answer:
        answer.raise_for_status()
        chunks, size = [], 0
        async for chunk in answer.aiter_bytes():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise TooLarge(f"over {MAX_BODY_BYTES:,} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


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
        try:
            le = float(s.labels.get("le", "inf"))
        except ValueError:
            continue  # a bucket bound that is not a number: leave the bucket out
        if math.isnan(le) or not math.isfinite(s.value) or s.value < 0:
            continue
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
