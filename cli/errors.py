"""Errors of the `qm` client and dev stack, one hierarchy so the CLI can report them plainly."""

from __future__ import annotations


class QmError(Exception):
    """Anything `qm` reports to the user as a message rather than a traceback."""


class InfraError(QmError):
    """A server could not be found or started."""


class ServerTimeout(InfraError):
    """A server or service did not answer in time, or its process exited while we waited."""

    def __init__(self, message: str, exited: bool = False) -> None:
        super().__init__(message)
        self.exited = exited


class StackError(QmError):
    """The platform could not be started, or its recorded state is unusable."""


class GatewayError(QmError):
    """The gateway could not be reached or answered with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
