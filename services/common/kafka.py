"""FastStream Kafka plumbing with the settings Tansu needs (shared/INFRA.md): the broker
factory, keyed publishing that waits for the broker, and envelope construction. Consumption
is in services.common.consumer."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from aiokafka import AIOKafkaProducer, ConsumerRecord
from faststream.kafka import KafkaBroker
from faststream.kafka.message import KafkaMessage
from faststream.kafka.prometheus import KafkaPrometheusMiddleware
from prometheus_client import CollectorRegistry

from schemas.envelope import Envelope
from services.common.partitioner import KeyPartitioner
from services.common.settings import ServiceSettings

# publish_batch and bursts of sends overflow aiokafka's 16 KB default batch (INFRA.md).
MAX_PRODUCER_BATCH = 1 << 20


# A message as the producer takes it: topic, key, value, headers, partition (None: by key).
Wire = tuple[str, str, bytes, tuple[tuple[str, str], ...], int | None]
# What became of one message: None once the broker has it, else the error.
Outcome = BaseException | None


@dataclass(frozen=True)
class OutMessage:
    """One message to publish: the topic, the partition key and the envelope; `partition`
    only where a message must go to one partition whatever its key (a leader's fence)."""

    topic: str
    key: str
    envelope: Envelope
    headers: tuple[tuple[str, str], ...] = ()
    partition: int | None = None

    def encode(self) -> bytes:
        return self.envelope.model_dump_json(exclude_none=True).encode()

    def wire(self) -> Wire:
        headers = (("type", self.envelope.type), *self.headers)
        if self.envelope.traceparent is not None:  # services.common.tracing
            headers = (*headers, ("traceparent", self.envelope.traceparent))
        return self.topic, self.key, self.encode(), headers, self.partition


def make_broker(
    settings: ServiceSettings, client_id: str, registry: CollectorRegistry | None = None
) -> KafkaBroker:
    middlewares = []
    if registry is not None:
        middlewares.append(
            KafkaPrometheusMiddleware(registry=registry, app_name=client_id, metrics_prefix="qm")
        )
    return KafkaBroker(
        settings.kafka_bootstrap,
        client_id=client_id,
        max_batch_size=MAX_PRODUCER_BATCH,
        max_request_size=4 * MAX_PRODUCER_BATCH,
        linger_ms=1,
        # A message counts as published only once every in-sync replica has it: with acks=1
        # a leader failover could lose an event whose outbox row was already deleted.
        acks="all",
        # aiokafka's choice of partition, without its byte-by-byte hash in Python on every send
        partitioner=KeyPartitioner(),
        middlewares=middlewares,
        logger=None,
    )


def records_of(message: KafkaMessage) -> tuple[ConsumerRecord[Any, Any], ...]:
    """The raw records of a batch. FastStream's in-memory test broker nests them one level
    deeper than the real consumer does; both shapes are accepted."""
    raw: Any = message.raw_message
    items = raw if isinstance(raw, tuple | list) else (raw,)
    flat: list[ConsumerRecord[Any, Any]] = []
    for item in items:
        flat.extend(item if isinstance(item, tuple | list) else (item,))
    return tuple(flat)


def raw_producer(broker: KafkaBroker) -> AIOKafkaProducer | None:
    """The connected aiokafka producer under a FastStream broker, or None (the in-memory test
    broker, a broker not connected yet, or a FastStream whose internals moved)."""
    state = getattr(getattr(broker, "_producer", None), "_producer", None)
    producer = getattr(state, "producer", None)
    return producer if isinstance(producer, AIOKafkaProducer) else None


async def send(
    broker: KafkaBroker,
    value: bytes,
    topic: str,
    key: str,
    headers: Iterable[tuple[str, str]],
    partition: int | None = None,
) -> Any:
    """Hand one message to the producer; returns the future of its acknowledgement (None on
    the in-memory test broker, which delivers at once). Straight to aiokafka when it can:
    FastStream's per-message publish path (command objects, codec, middlewares) was most of
    the scheduler leader's publishing time (docs/performance.md)."""
    producer = raw_producer(broker)
    if producer is not None:
        return await producer.send(
            topic,
            value,
            key=key.encode(),
            partition=partition,
            headers=[(k, v.encode()) for k, v in headers],
        )
    # Anything else with FastStream's publish (the in-memory test broker, the meter's batch
    # publisher): `partition` only when one is asked for, as not every one takes it.
    where: dict[str, Any] = {} if partition is None else {"partition": partition}
    fut = await broker.publish(
        value, topic, key=key.encode(), headers=dict(headers), no_confirm=True, **where
    )
    return fut if inspect.isawaitable(fut) else None


async def send_each(
    broker: KafkaBroker,
    messages: Sequence[Wire],
    *,
    stop: Callable[[Exception], bool] = lambda _exc: False,
) -> list[Outcome]:
    """Send every message and wait for every answer; the outcome of each, in order. A message
    the producer refuses before sending gets its error; when `stop(error)` says so, the rest
    are not sent and get the same error (the broker is away: each would wait out the same
    timeout)."""
    many = getattr(broker, "send_many", None)
    if many is not None:  # a publisher that batches by itself (the meter's relay)
        return cast(list[Outcome], await many(messages))
    outcomes: list[Outcome] = [None] * len(messages)
    futures: list[tuple[int, Any]] = []
    for i, (topic, key, value, headers, partition) in enumerate(messages):
        try:
            fut = await send(broker, value, topic, key, headers, partition)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            outcomes[i] = exc
            if stop(exc):
                outcomes[i + 1 :] = [exc] * (len(messages) - i - 1)
                break
            continue
        if fut is not None:  # None: the in-memory test broker delivered it at once
            futures.append((i, fut))
    results = await asyncio.gather(*(f for _, f in futures), return_exceptions=True)
    for (i, _), result in zip(futures, results, strict=True):
        if isinstance(result, BaseException):
            outcomes[i] = result
    return outcomes


async def publish_all(broker: KafkaBroker, messages: Iterable[OutMessage]) -> int:
    """Send every message with its key (per-entity order) and wait until the broker has all."""
    pending: list[asyncio.Future[Any]] = []
    for msg in messages:
        topic, key, value, headers, partition = msg.wire()
        fut = await send(broker, value, topic, key, headers, partition)
        if fut is not None:
            pending.append(fut)
    if pending:
        await asyncio.gather(*pending)
    return len(pending)


def envelope_for(
    event_type: str,
    payload: Any,
    *,
    producer: str,
    tenant: str | None = None,
    cause: Envelope | None = None,
    occurred_at: datetime | None = None,
) -> Envelope:
    """A new envelope; trace id and causation follow from the event that caused it. Its time
    is now, or `occurred_at`: the moment a decision was taken, when the event states a
    deadline counted from it."""
    body = (
        payload.model_dump(mode="json", exclude_none=True)
        if hasattr(payload, "model_dump")
        else dict(payload)
    )
    extra: dict[str, Any] = {}
    if cause is not None:
        extra = {"trace_id": cause.trace_id, "causation_id": cause.event_id}
    if occurred_at is not None:
        extra["occurred_at"] = occurred_at
    return Envelope(type=event_type, producer=producer, tenant=tenant, payload=body, **extra)


def decode_key(record: ConsumerRecord[Any, Any]) -> str | None:
    key = record.key
    if key is None:
        return None
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else str(key)
