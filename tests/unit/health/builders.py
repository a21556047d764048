"""Readable builders for the health tests: a rule set with short timings, probes, progress
reports of a gang, a clock."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from schemas.health import Severity, SignalKind
from services.health.book import (
    Beat,
    Changes,
    Draft,
    HealthBook,
    Incident,
    Seen,
    check,
    heartbeats_seen,
    inventory_seen,
    probes_seen,
)
from services.health.machine import NodeState
from services.health.pace import Progress, ReplicaStep
from services.health.rules import HealthRules, Rule, StragglerRules, Timings
from services.health.stragglers import expired, progress_seen

T0 = datetime(2025, 1, 1, tzinfo=UTC)

TIMINGS = Timings(
    suspect_after_s=15,
    unhealthy_after_s=30,
    min_quarantine_s=60,
    clean_period_s=120,
    cluster_min_nodes=2,
)
RULES = HealthRules(
    rules=(
        Rule("xid_79", SignalKind.GPU_XID, Severity.CRITICAL, "reset", frozenset({79}), True),
        Rule(
            "xid_other",
            SignalKind.GPU_XID,
            Severity.WARNING,
            "look",
            threshold=3,
            window_s=600,
        ),
        Rule("nvlink_down", SignalKind.NVLINK_DOWN, Severity.CRITICAL, "fabric", critical=True),
        Rule(
            "thermal",
            SignalKind.THERMAL_THROTTLE,
            Severity.WARNING,
            "cool",
            threshold=3,
            window_s=60,
        ),
    ),
    timings=TIMINGS,
)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def probe(
    node: str, t: float, kind: SignalKind = SignalKind.THERMAL_THROTTLE, xid: int | None = None
) -> Seen:
    return Seen(node, cluster_of(node), kind, xid, None, "", at(t))


def gang(
    job: str,
    t: float,
    *steps: float,
    nodes: Sequence[str] | None = None,
    attempt: int = 1,
    cluster: str = "g",
) -> Progress:
    """A progress report of `job` at `t`: replica i ran `steps[i]` s per step on `nodes[i]`
    (default `<cluster>-<i>`)."""
    on = list(nodes) if nodes is not None else [f"{cluster}-{i}" for i in range(len(steps))]
    replicas = tuple(ReplicaStep(i, n, s) for i, (n, s) in enumerate(zip(on, steps, strict=True)))
    return Progress(job, attempt, cluster, replicas, at(t))


def with_straggler(**overrides: Any) -> HealthRules:
    """The test rules with some straggler settings replaced."""
    return replace(RULES, straggler=replace(StragglerRules(), **overrides))


def beat(node: str, t: float) -> Beat:
    return Beat(node, cluster_of(node), at(t))


def cluster_of(node: str) -> str:
    """Nodes are named `<cluster>-<n>`."""
    return node.rsplit("-", 1)[0]


class Fleet:
    """A health book driven like the service drives it: each step decides, then applies."""

    def __init__(self, rules: HealthRules = RULES, watch_from: float = 0.0) -> None:
        self.book = HealthBook()
        self.rules = rules
        self.watch_from = at(watch_from)
        self._ids = itertools.count(1)
        self.log: list[Changes] = []

    def _draft(self) -> Draft:
        return Draft(self.book, self.rules, lambda: f"inc-{next(self._ids)}")

    def _apply(self, d: Draft) -> Changes:
        self.book.apply(d.changes)
        self.log.append(d.changes)
        return d.changes

    def beats(self, t: float, *nodes: str) -> Changes:
        """Heartbeats; a node heard of for the first time is listed by its executor first
        (only inventoried nodes are watched)."""
        d = self._draft()
        self._list(d, nodes, t)
        heartbeats_seen(d, [beat(n, t) for n in nodes])
        return self._apply(d)

    def probes(self, now: float, *seen: Seen) -> Changes:
        d = self._draft()
        self._list(d, [s.node_id for s in seen], min((s.at for s in seen), default=at(now)))
        probes_seen(d, seen, at(now))
        return self._apply(d)

    @staticmethod
    def _list(d: Draft, nodes: Iterable[str], when: float | datetime) -> None:
        stamp = when if isinstance(when, datetime) else at(when)
        for n in nodes:
            if d.node(n) is None:
                # An inventory lists every node of its cluster: the ones known so far too.
                cluster = cluster_of(n)
                known = [k.node_id for k in d.all_nodes() if k.cluster == cluster]
                inventory_seen(d, cluster, [*known, n], stamp)

    def check(self, now: float) -> Changes:
        d = self._draft()
        check(d, at(now), self.watch_from)
        expired(d, at(now), self.watch_from)
        return self._apply(d)

    def progress(self, now: float, *reports: Progress) -> Changes:
        d = self._draft()
        progress_seen(d, reports, at(now))
        return self._apply(d)

    def reports(
        self,
        job: str,
        times: Iterable[float],
        *steps: float,
        nodes: Sequence[str] | None = None,
        attempt: int = 1,
    ) -> None:
        """The same step times reported at each of `times` (each report judged at its time)."""
        for t in times:
            self.progress(t, gang(job, t, *steps, nodes=nodes, attempt=attempt))

    def state(self, node: str) -> NodeState:
        return self.book.nodes[node].state

    def alerts(self) -> list[Incident]:
        return [c.incidents[i] for c in self.log for i in c.alerts]

    def unhealthy(self) -> list[str]:
        return [u.node.node_id for c in self.log for u in c.unhealthy]

    def recovered(self) -> list[str]:
        return [r.node.node_id for c in self.log for r in c.recovered]
