"""What the meter publishes: every tick is a valid UsageTick in a valid Envelope, ids are
unique and sortable, and the committed JSON Schema of usage.tick is the generated one."""

from __future__ import annotations

import uuid

from schemas.envelope import Envelope
from schemas.usage import UsageTick
from services.meter.emit import batch_ids, tick_messages
from services.meter.overhead import OverheadPolicy, idle_ticks
from services.meter.pricing import Pool
from services.meter.ticks import close_run, micros
from tests.unit.meter.builders import T0, grid, run


def test_ticks_on_the_wire_validate_and_carry_the_amounts() -> None:
    g = grid(60, 600)
    ticks = close_run(run(count="0.5", start=T0, g=g), micros("130.5"), g, "failed")
    ticks += idle_ticks(
        g.index(g.virtual(T0)),
        [Pool("c", "H100", "reserved", 8, 2_100_000)],
        {},
        g,
        OverheadPolicy(),
    )
    messages = tick_messages(ticks, g, "EUR")
    assert len({m.envelope.type for m in messages}) == 1
    envelopes = [Envelope.model_validate_json(m.encode()) for m in messages]
    assert len({e.event_id for e in envelopes}) == len(envelopes)
    payloads = [UsageTick.model_validate(e.payload) for e in envelopes]
    assert [p.tick_id for p in payloads] == [t.tick_id for t in ticks]
    assert all(
        m.key == p.tenant == e.tenant for m, p, e in zip(messages, payloads, envelopes, strict=True)
    )
    close = payloads[-2]
    assert (close.kind.value, close.outcome, close.currency) == ("close", "failed", "EUR")
    assert sum(p.seconds for p in payloads if p.job_id) == 130.5
    assert payloads[-1].job_id is None and payloads[-1].kind.value == "idle"
    assert close.interval_s == 60 and close.interval_start.tzinfo is not None


def test_the_ledger_columns_are_the_tick_fields_in_order() -> None:
    from services.meter.store import _COLUMN_NAMES
    from services.meter.ticks import Tick

    assert list(Tick._fields) == _COLUMN_NAMES  # COPY sends ticks as they are


def test_batch_ids_are_uuid7_unique_and_in_order() -> None:
    ids = batch_ids(1000)
    assert len(set(ids)) == 1000 and sorted(ids) == ids
    assert {uuid.UUID(i).version for i in ids} == {7}


def test_the_published_json_schema_is_current() -> None:
    """docs/schemas/usage.tick.json as schemas.export writes it once the registry names
    UsageTick as the payload of usage.tick."""
    from dataclasses import replace

    from schemas.export import DEFAULT_OUT, _schema_of, render
    from schemas.topics import BY_NAME

    topic = replace(BY_NAME["usage.tick"], payload=UsageTick)
    expected = render(_schema_of(topic))  # type: ignore[arg-type]
    assert (DEFAULT_OUT / "usage.tick.json").read_text() == expected, (
        "regenerate docs/schemas/usage.tick.json (see this test)"
    )
