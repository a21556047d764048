"""Publishing the leader's decisions and learning, message by message, whether the broker
has each one: the cycle applies to its state only what was acknowledged."""

from __future__ import annotations

from collections.abc import Sequence

from faststream.kafka import KafkaBroker

from services.common.errors import refused_for_good
from services.common.kafka import Outcome, OutMessage, send_each


async def publish_each(broker: KafkaBroker, messages: Sequence[OutMessage]) -> list[Outcome]:
    """Send every message with its key and wait for each answer: None once the broker has
    acknowledged it, else the error.

    A message the producer would not take because the broker is away (no metadata, a full
    buffer) stops the sending: the rest would each wait out the same timeout, so they are
    given the same error unsent. One refused for good (too large) fails alone. An error is not
    proof of absence (an acknowledgement can be lost after the write), so a caller must read
    the log back before deciding again."""
    return await send_each(
        broker, [m.wire() for m in messages], stop=lambda exc: not refused_for_good(exc)
    )
