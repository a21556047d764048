"""What the meter announces: usage ticks, budget thresholds and their alerts, as outbox
messages. Ticks are the hot path (tens of thousands a second), so their envelopes are
written as JSON text rather than validated models: the values come from our own dataclasses,
and tests check that every tick validates as a UsageTick in an Envelope and that the text is
the JSON of the dict form (`tick_payload`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic_core import to_json

from schemas import topics
from schemas.envelope import Envelope
from schemas.usage import BudgetExceeded
from services.common.kafka import OutMessage, envelope_for
from services.meter.budgets import alert_for
from services.meter.ticks import MICRO, Grid, Tick

PRODUCER = "meter"


def batch_ids(n: int) -> list[str]:
    """n distinct UUIDv7 ids (the envelope's sortable event ids) for one batch: one clock read
    and one random draw, then a counter in the low random bits (RFC 9562 allows it), which
    is much cheaper per tick than drawing each id on its own."""
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    base = (millis & ((1 << 48) - 1)) << 80 | (rand >> 68) << 64 | (rand & ((1 << 30) - 1)) << 32
    base |= 0x7 << 76 | 0x2 << 62
    out = []
    for i in range(n):
        h = f"{base | i:032x}"
        out.append(f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    return out


def _fixed(t: Tick, grid: Grid, currency: str) -> dict[str, Any]:
    """The fields every tick of one run and tier (or idle pool) has in common."""
    body: dict[str, Any] = {
        "run_id": t.run_id,
        "tenant": t.tenant,
        "project": t.project,
        "user": t.user,
        "cluster": t.cluster,
        "accelerator_type": t.accelerator_type,
        "price_tier": t.price_tier,
        "interval_s": grid.interval_s,
        "currency": currency,
    }
    if t.job_id is not None:
        body["job_id"] = t.job_id
        body["attempt"] = t.attempt
    return body


def tick_payload(
    t: Tick, grid: Grid, currency: str, fixed: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The UsageTick payload (schemas.usage.UsageTick) of a tick, ready for JSON."""
    body = dict(fixed or _fixed(t, grid, currency))
    body["tick_id"] = t.tick_id
    body["kind"] = t.kind  # a StrEnum: serialised as its value
    body["count"] = t.count_u / MICRO
    body["interval_index"] = t.interval_index
    body["interval_start"] = t.interval_start
    body["interval_end"] = t.interval_end
    body["start_offset_s"] = t.start_offset_u / MICRO
    body["end_offset_s"] = t.end_offset_u / MICRO
    body["seconds"] = t.seconds_u / MICRO
    body["accelerator_seconds"] = t.accelerator_seconds_u / MICRO
    body["unit_price"] = t.unit_price_u / MICRO
    body["cost"] = t.cost_u / MICRO
    if t.outcome is not None:
        body["outcome"] = t.outcome
    return body


@dataclass(frozen=True)
class EncodedTick(OutMessage):
    """A usage tick whose bytes are made once, as text (`tick_messages`). `envelope` holds what the
    ticks of one batch share (type, producer, time, trace); the bytes are the whole envelope,
    each with its own event id. The outbox and the relay only read `envelope.type` and
    `encode()`; validating and dumping a model per tick would cost more than all the rest."""

    body: bytes = b""

    def encode(self) -> bytes:
        return self.body


# The C escaper behind json.dumps for one string (quotes, backslashes, control characters and
# anything beyond ASCII escaped): valid JSON whatever an id holds.
_string: Callable[[str], str] = json.encoder.encode_basestring_ascii


def tick_messages(ticks: list[Tick], grid: Grid, currency: str) -> list[OutMessage]:
    """The ticks of one batch or clock pass share its time and trace.

    Each envelope is written as text: what a run's ticks share (the envelope's head, the
    tenant, the payload's fixed fields) is encoded once per run and tier, and each tick adds
    its own fields: about half the cost of building a dict per tick and serialising it.
    `tick_payload` is the same payload as a dict; a test holds the two to the same JSON."""
    ids = batch_ids(len(ticks) + 1)
    shared = Envelope(type="UsageTick", producer=PRODUCER, trace_id=ids.pop())
    head = to_json(
        {
            "type": "UsageTick",
            "version": 1,
            "occurred_at": shared.occurred_at,
            "producer": PRODUCER,
            "trace_id": shared.trace_id,
        }
    ).decode()[:-1]  # open: the rest of each envelope follows
    prefixes: dict[tuple[str, str, str], str] = {}
    instants: dict[datetime, str] = {}
    out: list[OutMessage] = []
    for t, event_id in zip(ticks, ids, strict=True):
        key = (t.run_id, t.price_tier, t.tenant)
        prefix = prefixes.get(key)
        if prefix is None:
            fixed = to_json(_fixed(t, grid, currency)).decode()[1:-1]
            prefix = prefixes[key] = f'{head},"tenant":{_string(t.tenant)},"payload":{{{fixed},'
        start = instants.get(t.interval_start)
        if start is None:
            start = instants[t.interval_start] = to_json(t.interval_start).decode()
        end = instants.get(t.interval_end)
        if end is None:
            end = instants[t.interval_end] = to_json(t.interval_end).decode()
        outcome = "" if t.outcome is None else f',"outcome":{_string(t.outcome)}'
        text = (
            f'{prefix}"tick_id":{_string(t.tick_id)},"kind":"{t.kind.value}",'
            f'"count":{t.count_u / MICRO!r},"interval_index":{t.interval_index},'
            f'"interval_start":{start},"interval_end":{end},'
            f'"start_offset_s":{t.start_offset_u / MICRO!r},'
            f'"end_offset_s":{t.end_offset_u / MICRO!r},"seconds":{t.seconds_u / MICRO!r},'
            f'"accelerator_seconds":{t.accelerator_seconds_u / MICRO!r},'
            f'"unit_price":{t.unit_price_u / MICRO!r},"cost":{t.cost_u / MICRO!r}{outcome}}},'
            f'"event_id":"{event_id}"}}'
        )
        # per-tenant order: finance partitions its books by tenant
        out.append(EncodedTick(topics.USAGE_TICK, t.tenant, shared, body=text.encode()))
    return out


def budget_messages(events: list[BudgetExceeded]) -> list[OutMessage]:
    out: list[OutMessage] = []
    for e in events:
        out.append(
            OutMessage(
                topics.BUDGET_EXCEEDED,
                e.tenant,
                envelope_for("BudgetExceeded", e, producer=PRODUCER, tenant=e.tenant),
            )
        )
        alert = alert_for(e, PRODUCER)
        out.append(
            OutMessage(
                topics.ALERT_RAISED,
                alert.subject,
                envelope_for("AlertRaised", alert, producer=PRODUCER, tenant=e.tenant),
            )
        )
    return out
