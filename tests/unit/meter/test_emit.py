"""What the meter publishes: every tick is a valid UsageTick in a valid Envelope, ids are
unique and sortable, and the committed JSON Schema of usage.tick is the generated one."""

from __future__ import annotations

import json
import uuid

from pydantic_core import to_json

from schemas.envelope import Envelope
from schemas.usage import UsageTick
from services.meter.emit import batch_ids, tick_messages, tick_payload
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


def test_the_written_text_is_the_reference_payload_whatever_the_ids_hold() -> None:
    """Each envelope is written as text for speed: parsed, it must be exactly the dict form
    (`tick_payload`) serialised by pydantic, for ids with quotes, backslashes, control
    characters and non-ASCII text, fractions, credits, outcomes and idle ticks."""
    g = grid(60, 600)
    odd = {
        "job_id": 'j"1\\x\n\u00e9\u2028',
        "tenant": 't\u00fcr"k',
        "project": "p\\q",
        "user": "\u00e5sa",
        "cluster": "c\t1",
        "accelerator_type": "H100",
    }
    ticks = close_run(run(count="0.37", start=T0, g=g, **odd), micros("250.25"), g, 'fa"il')
    ticks += close_run(run(count="8", start=T0, g=g, job_id="plain"), micros("1e-6"), g, None)
    ticks += idle_ticks(
        g.index(g.virtual(T0)),
        [Pool('c"x', "H100", "spot", 8, 2_100_000)],
        {},
        g,
        OverheadPolicy(),
    )
    messages = tick_messages(ticks, g, 'E"UR')
    head = json.loads(messages[0].encode())
    assert head["type"] == "UsageTick" and head["producer"] == "meter" and head["version"] == 1
    for m, t in zip(messages, ticks, strict=True):
        written = json.loads(m.encode())
        reference = json.loads(to_json(tick_payload(t, g, 'E"UR')))
        assert written["payload"] == reference
        assert written["tenant"] == t.tenant == m.key
        assert {k: written[k] for k in ("occurred_at", "trace_id")} == {
            k: head[k] for k in ("occurred_at", "trace_id")
        }
    assert len({json.loads(m.encode())["event_id"] for m in messages}) == len(messages)


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
