"""The cluster's elastic node pools on the simulated fleet: an `autoscale.decided` sets a pool's
size; nodes asked for join after the pool's provisioning delay (or never, with the pool's
seeded stockout chance), and nodes the decision names go if nothing runs on them. No I/O here:
the executor's app stores the members and announces what changed (docs/autoscaler.md)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from core.autoscale import NodePool
from core.model import Node
from schemas.events import AutoscaleDecided, PoolNode, PoolNodeState, PoolStatus

EPS = 1e-9


@dataclass
class Member:
    """One node of a pool: asked for at `requested_at`, ready once `ready_at` is set."""

    node_id: str
    pool: str
    requested_at: datetime
    ready_at: datetime | None = None
    # Drawn when it is asked for (seeded): this request will not be met.
    stockout: bool = False
    empty_since: datetime | None = None


@dataclass(frozen=True)
class Change:
    asked: list[Member]  # new members (provisioning)
    dropped: list[Member]  # members gone: removed, canceled while provisioning, stocked out
    joined: list[Member]  # members now ready


class PoolBook:
    def __init__(
        self,
        cluster: str,
        pools: Sequence[NodePool],
        time_scale: float,
        seed: int | None = None,
    ) -> None:
        self.cluster = cluster
        self.pools = {p.name: p for p in pools}
        self.time_scale = time_scale
        self.members: dict[str, Member] = {}
        self.desired = {p.name: p.min_nodes for p in pools}
        # The next node number per pool: never reused, so a node id names one machine only
        # (the health service and the meter keep history by node id).
        self.next_seq = {p.name: 0 for p in pools}
        self.failing: dict[str, tuple[str, datetime]] = {}
        # When the newest decision applied per pool was taken.
        self.applied_at: dict[str, datetime] = {}
        self._rng = random.Random(seed)

    # --- members ----------------------------------------------------------------------------

    def restore(
        self,
        members: Sequence[Member],
        sizes: dict[str, tuple[int, int]],
        applied_at: dict[str, datetime] | None = None,
    ) -> None:
        """Members, (desired size, next node number) and the newest decision's time per pool,
        as stored."""
        for name, at in (applied_at or {}).items():
            if name in self.pools:
                self.applied_at[name] = at
        for m in members:
            if m.pool in self.pools:
                self.members[m.node_id] = m
                self.next_seq[m.pool] = max(self.next_seq[m.pool], _seq(m.node_id) + 1)
        for name, (size, next_seq) in sizes.items():
            if name in self.pools:
                self.desired[name] = size
                self.next_seq[name] = max(self.next_seq[name], next_seq)

    def of(self, pool: str) -> list[Member]:
        return sorted((m for m in self.members.values() if m.pool == pool), key=lambda m: m.node_id)

    def node(self, m: Member) -> Node:
        return self.pools[m.pool].node(m.node_id, _seq(m.node_id))

    def ready_nodes(self) -> dict[str, Node]:
        return {m.node_id: self.node(m) for m in self.members.values() if m.ready_at is not None}

    # --- decisions and time -------------------------------------------------------------------

    def accept(self, d: AutoscaleDecided, decided_at: datetime | None) -> NodePool | None:
        """The pool a decision is for, if it is ours and not older than one applied (a replay
        from an old offset: its remove list is stale); it is then the newest applied."""
        pool = self.pools.get(d.pool)
        if pool is None or d.cluster != self.cluster:
            return None
        last = self.applied_at.get(pool.name)
        if decided_at is not None and last is not None and decided_at < last:
            return None
        if decided_at is not None:
            self.applied_at[pool.name] = decided_at
        return pool

    def apply(
        self,
        d: AutoscaleDecided,
        now: datetime,
        busy: Callable[[str], bool],
        decided_at: datetime | None = None,
    ) -> Change:
        """Set the pool's size: ask for the nodes missing, drop those named if nothing is
        booked on them (one that took work meanwhile stays, and counts on top of the size: the
        autoscaler will look again), and provisioning ones beyond the size, newest first —
        never one asked for after the inventory the decision was taken on."""
        pool = self.accept(d, decided_at)
        if pool is None:
            return Change([], [], [])
        dropped, kept = [], 0
        for node_id in d.remove:
            m = self.members.get(node_id)
            if m is None or m.pool != pool.name or m.ready_at is None:
                continue
            if busy(node_id):
                kept += 1
            else:
                dropped.append(self.members.pop(node_id))
        size = max(pool.min_nodes, min(d.desired_nodes + kept, pool.max_nodes))
        self.desired[pool.name] = size
        live = self.of(pool.name)
        extra = len(live) - size
        for m in sorted(live, key=lambda m: m.requested_at, reverse=True):
            if extra <= 0:
                break
            newer = d.inventory_at is not None and m.requested_at > d.inventory_at
            if m.ready_at is None and not newer:
                dropped.append(self.members.pop(m.node_id))
                extra -= 1
        asked = []
        for _ in range(size - len(self.of(pool.name))):
            m = Member(
                self._next_id(pool.name),
                pool.name,
                now,
                stockout=self._rng.random() < pool.stockout_rate,
            )
            self.members[m.node_id] = m
            asked.append(m)
        return Change(asked, dropped, [])

    def due(self, now: datetime) -> Change:
        """Members whose provisioning time is up: ready, or gone for a stockout."""
        joined, dropped = [], []
        for m in list(self.members.values()):
            if m.ready_at is not None:
                continue
            pool = self.pools[m.pool]
            if now < m.requested_at + timedelta(seconds=pool.provision_s / self.time_scale):
                continue
            if m.stockout:
                dropped.append(self.members.pop(m.node_id))
                self.failing[m.pool] = (
                    f"stockout: {pool.accelerator.type} x {pool.accelerators_per_node} "
                    f"({pool.price_tier.value}) not available in {self.cluster}",
                    now,
                )
            else:
                m.ready_at = m.empty_since = now
                self.failing.pop(m.pool, None)
                joined.append(m)
        return Change([], dropped, joined)

    def note_use(self, busy: Callable[[str], bool], now: datetime) -> None:
        for m in self.members.values():
            if m.ready_at is None:
                continue
            if busy(m.node_id):
                m.empty_since = None
            elif m.empty_since is None:
                m.empty_since = now

    def status(self, used: Callable[[str], float]) -> list[PoolStatus]:
        out = []
        for name, pool in sorted(self.pools.items()):
            out.append(
                PoolStatus(
                    pool=name,
                    accelerator_type=pool.accelerator.type,
                    accelerators_per_node=pool.accelerators_per_node,
                    price_tier=pool.price_tier.value,
                    min_nodes=pool.min_nodes,
                    max_nodes=pool.max_nodes,
                    desired_nodes=self.desired.get(name, pool.min_nodes),
                    failing=self.failing[name][0] if name in self.failing else None,
                    failed_at=self.failing[name][1] if name in self.failing else None,
                    nodes=[
                        PoolNode(
                            node_id=m.node_id,
                            state=PoolNodeState.READY if m.ready_at else PoolNodeState.PROVISIONING,
                            requested_at=m.requested_at,
                            ready_at=m.ready_at,
                            used=round(used(m.node_id), 6) if m.ready_at else 0.0,
                            empty_since=m.empty_since,
                        )
                        for m in self.of(name)
                    ],
                )
            )
        return out

    def _next_id(self, pool: str) -> str:
        seq = self.next_seq[pool]
        self.next_seq[pool] = seq + 1
        return f"{self.cluster}-{pool}-{seq:04d}"


def _seq(node_id: str) -> int:
    match = re.search(r"(\d+)$", node_id)
    return int(match.group(1)) if match else 0
