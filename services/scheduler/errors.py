"""The scheduler's failures, in the classes of services.common.errors."""

from __future__ import annotations

from services.common.errors import RetryableError, describe


class PublishFailed(RetryableError):
    """Part of a cycle's messages did not reach the broker. What did was applied to the state;
    the rest was not, and its jobs are decided again once the log has been read back."""

    def __init__(self, failed: int, total: int, first: BaseException) -> None:
        super().__init__(f"{failed} of {total} messages not acknowledged ({describe(first)})")
        self.failed = failed
        self.total = total
