"""Errors shared by services: retryable ones rewind the batch, permanent ones dead-letter."""


class ServiceError(Exception):
    """Base of every error a service raises on purpose."""


class RetryableError(ServiceError):
    """The effect could not be made durable now (store or broker away); redeliver the batch."""


class PermanentError(ServiceError):
    """The input can never be processed; dead-letter it with this message."""
