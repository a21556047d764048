"""Which pending jobs the scheduler tells why they wait, per cycle: changes only, and at most
a cap, most useful first (never told, then new reasons, then the stalest sentences)."""

from __future__ import annotations

from core.model import JobId
from core.reasons import PendingExplanation, ReasonCode
from services.scheduler.cycle import EXPLAIN_EVERY_S, worth_telling

FULL = (ReasonCode.INSUFFICIENT_CAPACITY,)
BEHIND = (ReasonCode.BEHIND_HIGHER_PRIORITY,)


def why(codes: tuple[ReasonCode, ...], message: str) -> PendingExplanation:
    return PendingExplanation(codes=codes, message=message)


def told(
    codes: tuple[ReasonCode, ...], message: str, at: float
) -> tuple[tuple[str, ...], str, float]:
    return (tuple(str(c) for c in codes), message, at)


def test_only_changes_go_out_and_a_new_sentence_waits_its_turn() -> None:
    now = 1000.0
    pending = {
        JobId("same"): why(FULL, "no room"),
        JobId("sentence-recent"): why(BEHIND, "behind 3 jobs"),
        JobId("sentence-old"): why(BEHIND, "behind 4 jobs"),
        JobId("codes"): why(FULL, "no room"),
        JobId("new"): why(FULL, "no room"),
    }
    history = {
        JobId("same"): told(FULL, "no room", now - 1),
        JobId("sentence-recent"): told(BEHIND, "behind 4 jobs", now - 1),
        JobId("sentence-old"): told(BEHIND, "behind 5 jobs", now - EXPLAIN_EVERY_S),
        JobId("codes"): told(BEHIND, "behind 1 job", now - 1),
    }
    assert set(worth_telling(pending, history, now)) == {"sentence-old", "codes", "new"}


def test_the_cap_keeps_the_most_useful() -> None:
    now = 1000.0
    pending = {JobId(f"s{i}"): why(BEHIND, "behind 1 job") for i in range(5)}
    history = {JobId(f"s{i}"): told(BEHIND, "behind 2 jobs", now - 100 + i) for i in range(5)}
    pending[JobId("new")] = why(FULL, "no room")
    pending[JobId("codes")] = why(FULL, "no room")
    history[JobId("codes")] = told(BEHIND, "behind 1 job", now - 1)
    assert worth_telling(pending, history, now, limit=3) == ["new", "codes", "s0"]
    # What waited goes out in a later cycle: the stalest first.
    history[JobId("s0")] = told(BEHIND, "behind 1 job", now)
    del pending[JobId("new")], pending[JobId("codes")]
    assert worth_telling(pending, history, now, limit=2) == ["s1", "s2"]
