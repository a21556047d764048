"""Carrying out `autoscale.decided` on the simulated fleet: the pool book (pools.py) decides,
this applies — nodes into and out of the executor's node book, the pools stored, and the
inventory announced again at once when it changed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime

import structlog
from pydantic import ValidationError

from core.model import Node
from schemas.events import AutoscaleDecided
from schemas.validation import describe_validation_error
from services.common.consumer import Records
from services.common.deadletter import dead_letter, decode_envelopes
from services.common.kafka import OutMessage
from services.executor.nodes import NodeBook
from services.executor.pools import Change, PoolBook
from services.executor.store import ExecutorStore, utcnow

log = structlog.get_logger()


class ElasticPools:
    # Seconds between looks at the pools (nodes due, empty nodes).
    every_s = 0.5

    def __init__(
        self,
        book: PoolBook,
        nodes: NodeBook,
        announce: Callable[[], None],
        publish: Callable[[list[OutMessage]], Awaitable[object]],
    ) -> None:
        self.book = book
        self.publish = publish  # dead letters
        self.consumer = f"executor/{book.cluster}/pools"
        self.nodes = nodes
        # Replaced by the executor's lock before the broker starts (app.py): placements and
        # node removals never interleave.
        self.changing = asyncio.Lock()
        self.announce = announce
        self.store: ExecutorStore | None = None
        self.unsaved = False

    async def start(self, store: ExecutorStore) -> None:
        """The stored pools; ready nodes go into the node book before the runs are booked."""
        self.store = store
        members, sizes, applied = await store.load_pools()
        self.book.restore(members, sizes, applied)
        for node in self.book.ready_nodes().values():
            self.nodes.upsert(node)
        log.info("pools restored", nodes=len(members), pools=len(self.book.pools))

    async def handle(self, records: Records) -> None:
        decoded, dead = decode_envelopes(records, consumer=self.consumer)
        for got in decoded:
            try:
                d = AutoscaleDecided.model_validate(got.envelope.payload)
            except ValidationError as error:
                message = describe_validation_error(error)
                dead.append(dead_letter(got.record, message, consumer=self.consumer))
                continue
            if d.cluster != self.book.cluster:
                continue
            if await self.decided(d, got.envelope.occurred_at):
                self.announce()
        if dead:
            await self.publish(dead)

    async def decided(self, d: AutoscaleDecided, decided_at: datetime | None) -> bool:
        """Apply one decision for this cluster; whether the pools changed."""
        async with self.changing:
            change = self.book.apply(d, utcnow(), self.nodes.busy, decided_at=decided_at)
            self._carry_out(change)
            await self._save()
        if not change.asked and not change.dropped:
            return False
        log.info(
            "pool resized",
            pool=d.pool,
            desired=d.desired_nodes,
            asked=[m.node_id for m in change.asked],
            dropped=[m.node_id for m in change.dropped],
            reason=d.reason,
        )
        return True

    def ready_nodes(self) -> dict[str, Node]:
        """The pools' ready nodes, for the inventory."""
        return self.book.ready_nodes()

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.tick(utcnow())
            except Exception as error:  # the store may be away: the next tick tries again
                log.warning("pool tick failed", error=str(error))

    async def tick(self, now: datetime) -> None:
        async with self.changing:
            self.book.note_use(self.nodes.busy, now)
            change = self.book.due(now)
            if not change.joined and not change.dropped:
                if self.unsaved:
                    await self._save()
                return
            self._carry_out(change)
            await self._save()
        for m in change.joined:
            log.info("pool node ready", pool=m.pool, node=m.node_id)
        for m in change.dropped:
            log.warning("pool node never came", pool=m.pool, node=m.node_id)
        self.announce()

    def _carry_out(self, change: Change) -> None:
        for m in change.joined:
            self.nodes.upsert(self.book.node(m))
        for m in change.dropped:
            if m.ready_at is not None and not self.nodes.remove(m.node_id):
                log.error("pool node dropped while booked", node=m.node_id)

    async def _save(self) -> None:
        """Store the pools; until that succeeds every tick tries again (memory is ahead)."""
        if self.store is None:
            return
        self.unsaved = True
        await self.store.save_pools(self.book)
        self.unsaved = False
