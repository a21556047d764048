"""What the meter announces: usage ticks, budget thresholds and their alerts, as outbox
messages. Ticks are the hot path (tens of thousands a second), so their envelopes are
built from plain dicts rather than validated models: the values come from our own dataclasses.
"""

from __future__ import annotations

from typing import Any

from schemas import topics
from schemas.envelope import Envelope, utcnow
from schemas.ids import new_id
from schemas.usage import BudgetExceeded
from services.common.kafka import OutMessage, envelope_for
from services.meter.budgets import alert_for
from services.meter.ticks import Grid, Tick

PRODUCER = "meter"


def tick_payload(t: Tick, grid: Grid, currency: str) -> dict[str, Any]:
    """The UsageTick payload (schemas.usage.UsageTick) of a tick, ready for JSON."""
    body: dict[str, Any] = {
        "tick_id": t.tick_id,
        "kind": t.kind.value,
        "run_id": t.run_id,
        "tenant": t.tenant,
        "project": t.project,
        "user": t.user,
        "cluster": t.cluster,
        "accelerator_type": t.accelerator_type,
        "price_tier": t.price_tier,
        "count": float(t.count),
        "interval_s": float(grid.interval_s),
        "interval_index": t.interval_index,
        "interval_start": t.interval_start.isoformat(),
        "interval_end": t.interval_end.isoformat(),
        "start_offset_s": float(t.start_offset_s),
        "end_offset_s": float(t.end_offset_s),
        "seconds": float(t.seconds),
        "accelerator_seconds": float(t.accelerator_seconds),
        "unit_price": float(t.unit_price),
        "cost": float(t.cost),
        "currency": currency,
    }
    if t.job_id is not None:
        body["job_id"] = t.job_id
        body["attempt"] = t.attempt
    if t.outcome is not None:
        body["outcome"] = t.outcome
    return body


def tick_messages(ticks: list[Tick], grid: Grid, currency: str) -> list[OutMessage]:
    now = utcnow()
    return [
        OutMessage(
            topics.USAGE_TICK,
            t.tenant,  # per-tenant order; finance partitions its books by tenant
            Envelope.model_construct(
                event_id=new_id(),
                type="UsageTick",
                version=1,
                occurred_at=now,
                producer=PRODUCER,
                tenant=t.tenant,
                trace_id=new_id(),
                causation_id=None,
                payload=tick_payload(t, grid, currency),
            ),
        )
        for t in ticks
    ]


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
