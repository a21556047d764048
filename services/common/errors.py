"""Failure classes for consumers: a failure that will pass, or one that never will.

A *retryable* failure (a store or the broker is away, a lock timed out, a serialization
conflict) is retried with backoff until it passes; giving the record up would lose it for no
reason. A *permanent* one (the record cannot be parsed, validated or stored) will fail the same
way on every try; the record is dead-lettered and its partition moves on. What is neither
known as retryable nor as permanent (a bug that a record's content provokes) counts as
permanent only while the service's stores answer, so an outage that surfaces as a strange
exception never turns every record into a dead letter.
"""

from __future__ import annotations

import asyncio
from enum import StrEnum

import asyncpg
from aiokafka.errors import (
    InvalidTopicError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    ProducerClosed,
    RecordListTooLargeError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas.bounds import escape_unsafe


class Failure(StrEnum):
    RETRYABLE = "retryable"
    PERMANENT = "permanent"
    UNKNOWN = "unknown"


class PermanentError(Exception):
    """Raised by a service step for a record that can never be applied, with the reason."""


class RetryableError(Exception):
    """Raised by a service step for a condition that will pass (a dependency is away)."""


# SQLSTATE classes (the first two characters) that a record's content provokes: cardinality
# violation, data exception (a NUL in a text value, a number out of range, bad encoding) and
# integrity constraint violation. The same record fails the same way on every try.
_PERMANENT_SQL_CLASSES = frozenset({"21", "22", "23"})
# Classes that pass with time: connection exceptions, transaction rollback (serialization,
# deadlock), insufficient resources, object not in prerequisite state (lock not available),
# operator intervention (shutdown, cannot connect now), system errors.
_RETRYABLE_SQL_CLASSES = frozenset({"08", "40", "53", "55", "57", "58", "XX"})


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, PermanentError):
        return Failure.PERMANENT
    if isinstance(exc, RetryableError):
        return Failure.RETRYABLE
    if isinstance(exc, asyncpg.PostgresError):
        state = str(getattr(exc, "sqlstate", "") or "")
        if state[:2] in _PERMANENT_SQL_CLASSES:
            return Failure.PERMANENT
        if state[:2] in _RETRYABLE_SQL_CLASSES:
            return Failure.RETRYABLE
        return Failure.UNKNOWN
    if isinstance(exc, asyncpg.InterfaceError | asyncpg.InternalClientError):
        # A connection closed under us, a pool closing, a protocol state after a restart.
        return Failure.RETRYABLE
    if isinstance(exc, KafkaTimeoutError | ProducerClosed):
        return Failure.RETRYABLE  # aiokafka calls these not retriable; they pass with time
    if isinstance(exc, KafkaError):
        return Failure.RETRYABLE if getattr(exc, "retriable", False) else Failure.UNKNOWN
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return Failure.RETRYABLE
    if isinstance(exc, OSError | TimeoutError | asyncio.TimeoutError):
        return Failure.RETRYABLE
    return Failure.UNKNOWN


# What a broker (or the producer, checking the same limits) answers a message it will never
# take, however often it is sent.
_REFUSALS = (MessageSizeTooLargeError, RecordListTooLargeError, InvalidTopicError)


def refused_for_good(exc: BaseException) -> bool:
    """True when the broker refuses this message itself (too large, a topic name it cannot
    have); anything else, authorisation included, may pass and is tried again."""
    return isinstance(exc, _REFUSALS)


def describe(exc: BaseException) -> str:
    """One line naming the error's type and message, for logs and dead letters."""
    text = str(exc).strip().splitlines()
    first = escape_unsafe(text[0][:1000]) if text else ""
    name = type(exc).__name__
    return f"{name}: {first}" if first else name
