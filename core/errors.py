"""Errors the scheduling core raises: only for malformed configuration, never for "does not fit"."""

from __future__ import annotations


class CoreError(Exception):
    """Base of every error raised by `core`; all are permanent (retrying cannot help)."""


class PolicyError(CoreError):
    """The policy document is malformed; the message names the offending key."""


class FleetError(CoreError):
    """The fleet document is malformed; the message names the offending key."""
