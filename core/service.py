"""Service levels: inside a priority class, which pending job goes first and which running job may
yield to a waiting one, by how much service (accelerator-seconds) each is expected to need.

Nobody declares a duration. `ordering: las` (Tiresias-like) levels jobs by the service they have
attained: the more a job has run, the later it goes. `service_levels.mode: learned` levels a job
by the service it is expected to need before its next chance of ending, from the total service of
jobs of its kind that finished before it: its Gittins index, `sup_d P(S - a <= d | S > a) /
E[min(S - a, d) | S > a]`, over the empirical distribution of S for its kind, given the service
`a` it has attained. The inverse of the index is the expected service spent per completion
("effort"); a job of a kind whose jobs are mostly short has a small effort and goes first; one
that has outlived most of its kind has a large one (and with a heavy-tailed history, the longer
it runs the larger), so it yields to newcomers as under LAS, but only as far as its kind
suggests. A kind is (tenant, accelerators asked); one with too few finished jobs borrows its
tenant's history, then everyone's; with no history at all every job is level 0 (the order is the
ordering mode's alone).

Levels are computed by the same code in the live scheduler and the simulator; both feed the
history with the same thing: a finished job's service over all its runs (`record`).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from core.model import JobRequest
from core.policy import LevelMode, OrderingMode, Policy

# The level of a job is cached per (kind, its summary's version, attained service rounded down
# to a step of this ratio), so a cycle asking about hundreds of running jobs costs lookups.
_ATTAINED_STEP = 1.1


def gittins_effort(samples: list[float], prefix: list[float], attained: float) -> float | None:
    """Expected service spent per completion for a job that has `attained` service, given the
    ascending `samples` of its kind's total service and their running sums `prefix` (prefix[i]
    is the sum of samples[:i]). None when no sample exceeds `attained` (nothing of its kind ran
    that long)."""
    first = bisect.bisect_right(samples, attained)
    n = len(samples) - first
    if n <= 0:
        return None
    best = math.inf
    # Serve up to the j-th longer sample: j of n finish, at a cost of the work done on all n.
    for j in range(1, n + 1):
        edge = samples[first + j - 1] - attained
        spent = (prefix[first + j] - prefix[first]) - j * attained + (n - j) * edge
        cost = spent / j
        if cost < best:
            best = cost
    return best


@dataclass
class _Kind:
    recent: deque[float]
    # Jobs recorded so far, and as of the summary below: what levels are computed from. The
    # summaries move on together, at most once per `service_levels.refresh_s` of fleet time
    # (`ServiceHistory.refresh`), so levels depend only on what was recorded and when the
    # cycles ran, never on when a level was asked; and pending jobs are re-levelled that often
    # at most, not after every end.
    version: int = 0
    summary_version: int = -1
    samples: list[float] = field(default_factory=list)
    prefix: list[float] = field(default_factory=list)

    def refresh(self) -> None:
        self.samples = sorted(self.recent)
        self.prefix = _prefix(self.samples)
        self.summary_version = self.version


KindKey = tuple[str, ...]


def kinds_of(job: JobRequest) -> tuple[KindKey, KindKey, KindKey]:
    """From the most to the least specific: tenant and size, tenant, everyone."""
    size = f"{job.total_accelerators:g}"
    return (("k", job.tenant, size), ("t", job.tenant), ("all",))


# Finished jobs remembered per kind.
PER_KIND = 256
# The most service one job counts for (about 32 million accelerator-years): sums of a kind's
# history stay finite, however hostile the run times read from the log.
MAX_SERVICE = 1e15
# A kind as a snapshot holds it: see `ServiceHistory.export`.
KindState = tuple[list[float], list[float], int, int]


@dataclass(eq=False)
class ServiceHistory:
    """The total service of the last `PER_KIND` finished jobs of each kind (and of each
    tenant, and of everyone)."""

    kinds: dict[KindKey, _Kind] = field(default_factory=dict)
    # Bumped whenever some kind's summary moves on: levels computed before may differ now.
    epoch: int = 0
    # Fleet time of the last refresh (none yet: -inf).
    refreshed_at: float = -math.inf

    def refresh(self, now: float, every_s: float) -> None:
        """Moves every kind's summary on to what it has recorded, if `every_s` have passed since
        the last time (fleet seconds; a clock that went back counts as passed)."""
        if self.refreshed_at <= now < self.refreshed_at + every_s:
            return
        self.refreshed_at = now
        moved = False
        for kind in self.kinds.values():
            if kind.summary_version != kind.version:
                kind.refresh()
                moved = True
        if moved:
            self.epoch += 1

    def record(self, job: JobRequest, service: float) -> None:
        """A job ended (succeeded, failed or was cancelled) after `service` accelerator-seconds
        over all its runs. A NaN, an infinity or a negative amount is not history; nor is a job
        that asked no accelerators (it would count as a zero-length job of its tenant); more
        than `MAX_SERVICE` counts as that much."""
        if not math.isfinite(service) or service < 0 or job.total_accelerators <= 0:
            return
        service = min(service, MAX_SERVICE)
        for key in kinds_of(job):
            kind = self.kinds.get(key)
            if kind is None:
                kind = self.kinds[key] = _Kind(deque(maxlen=PER_KIND))
            kind.recent.append(service)
            kind.version += 1

    def kind_for(self, job: JobRequest, min_samples: int) -> tuple[KindKey, _Kind] | None:
        for key in kinds_of(job):
            kind = self.kinds.get(key)
            if kind is not None and len(kind.samples) >= min_samples:
                return key, kind
        return None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ServiceHistory)
            and self.export() == other.export()
            and self.refreshed_at == other.refreshed_at
        )

    __hash__ = None  # type: ignore[assignment]

    def export(self) -> dict[str, KindState]:
        """For a snapshot: kind (joined with '\\x1f') -> (remembered service oldest first, the
        summary levels are computed from, jobs recorded, jobs recorded as of the summary), so
        a restored history levels exactly as this one and refreshes at the same points."""
        return {
            "\x1f".join(key): (list(k.recent), list(k.samples), k.version, k.summary_version)
            for key, k in self.kinds.items()
        }

    @classmethod
    def restore(
        cls, saved: Mapping[str, KindState], refreshed_at: float | None = None
    ) -> ServiceHistory:
        """The history `export` described. Values a snapshot should not hold (NaN, infinite,
        negative, past `MAX_SERVICE`) are dropped, and a summary that is not the sorted values
        it claims to be is rebuilt from the remembered ones."""
        history = cls()
        for name, (values, samples, version, summary_version) in saved.items():
            recent: deque[float] = deque(_sane(values), maxlen=PER_KIND)
            kind = _Kind(recent, version=max(version, len(recent)))
            summary = list(_sane(samples))
            never = summary_version == -1 and not summary  # recorded, not yet learned from
            if never or (summary == sorted(summary) and 0 <= summary_version <= kind.version):
                kind.samples, kind.prefix = summary, _prefix(summary)
                kind.summary_version = summary_version
            else:
                kind.refresh()
            history.kinds[tuple(name.split("\x1f"))] = kind
        history.epoch = 1
        if refreshed_at is not None and math.isfinite(refreshed_at):
            history.refreshed_at = refreshed_at
        return history


def _sane(values: Iterable[float]) -> Iterator[float]:
    return (float(v) for v in values if math.isfinite(v) and 0 <= v <= MAX_SERVICE)


def _prefix(samples: list[float]) -> list[float]:
    prefix = [0.0]
    for value in samples:
        prefix.append(prefix[-1] + value)
    return prefix


@dataclass
class Levels:
    """The service level of a job (0 goes first) under a policy, with the history it learns
    from when the policy asks for learned levels."""

    policy: Policy
    history: ServiceHistory = field(default_factory=ServiceHistory)
    _cache: dict[tuple[KindKey, int, int], int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether levels can differ at all (else every job is level 0)."""
        return (
            self.policy.ordering is OrderingMode.LAS
            or self.policy.service_levels.mode is LevelMode.LEARNED
        )

    @property
    def preempt_gap(self) -> int:
        """How many levels above a waiting job a running one of its rank must be to yield to
        it for service alone; 0: service alone never makes a job yield."""
        if self.policy.ordering is OrderingMode.LAS:
            return 1
        if self.policy.service_levels.mode is LevelMode.LEARNED:
            return self.policy.service_levels.preempt_gap
        return 0

    def level(self, job: JobRequest, attained: float) -> int:
        policy = self.policy
        if policy.ordering is OrderingMode.LAS:
            return bisect.bisect_right(policy.las.thresholds, attained)
        if policy.service_levels.mode is not LevelMode.LEARNED:
            return 0
        found = self.history.kind_for(job, policy.service_levels.min_samples)
        if found is None:
            return 0
        key, kind = found
        samples, prefix = kind.samples, kind.prefix
        if not attained < MAX_SERVICE:  # also NaN: a job past any history is levelled last
            return policy.service_levels.levels - 1
        step = -1 if attained <= 1 else int(math.log(attained) / math.log(_ATTAINED_STEP))
        cached = self._cache.get((key, kind.summary_version, step))
        if cached is not None:
            return cached
        # The level of the step's lower edge: every job in the step gets the same one.
        edge = 0.0 if step < 0 else _ATTAINED_STEP**step
        effort = gittins_effort(samples, prefix, edge)
        value = self._level_of(edge if effort is None else effort)
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[(key, kind.summary_version, step)] = value
        return value

    def _level_of(self, effort: float) -> int:
        """Level 0 up to `base_s` of effort, then one more per `ratio` times as much. A job that
        outlived all its kind's history is levelled by what it has attained (as under LAS)."""
        sl = self.policy.service_levels
        if effort <= sl.base_s:
            return 0
        if not math.isfinite(effort):
            return sl.levels - 1
        return min(sl.levels - 1, 1 + int(math.log(effort / sl.base_s) / math.log(sl.ratio)))

    def refresh(self, now: float) -> None:
        """At the start of a cycle (fleet time `now`): see `ServiceHistory.refresh`."""
        if self.policy.service_levels.mode is LevelMode.LEARNED:
            self.history.refresh(now, self.policy.service_levels.refresh_s)

    @property
    def epoch(self) -> int:
        """Changes whenever a level computed earlier may have changed (LAS levels depend on
        attained service alone: never)."""
        if self.policy.service_levels.mode is not LevelMode.LEARNED:
            return 0
        return self.history.epoch

    def record(self, job: JobRequest, service: float) -> None:
        self.history.record(job, service)
