"""The fleet's health and its open incidents, and the pure decisions over them: what a batch of
heartbeats, probes and inventories changes, and what a periodic check (silence, recovery)
changes. Decisions come back as `Changes` (data); the service persists and announces them.

Incidents make "one alert per incident, not per probe": a quarantine opens an incident and
raises its one alert; later signals only bump its count. A whole cluster going dark is one
cluster incident shared by all its nodes. The book also holds the straggler detector's job
tracks (services.health.pace); services.health.stragglers decides over them.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from schemas.health import Severity, SignalKind
from services.health import machine
from services.health.machine import NodeHealth, NodeState, Signal, Verdict
from services.health.pace import Straggle, Track
from services.health.rules import HEARTBEAT_LOST, STRAGGLER, HealthRules

IdFactory = Callable[[], str]


@dataclass(frozen=True)
class Incident:
    incident_id: str  # also the alert id
    subject: str  # node id, or cluster name for a cluster incident
    cluster: str
    node_id: str | None
    cause: str
    severity: Severity
    suggested_action: str
    first_seen: datetime
    last_seen: datetime
    count: int
    closed_at: datetime | None = None


@dataclass(frozen=True)
class Beat:
    node_id: str
    cluster: str
    at: datetime


@dataclass(frozen=True)
class Seen:
    """A probe as the decisions need it (converted from the wire model at the edge)."""

    node_id: str
    cluster: str
    kind: SignalKind
    xid: int | None
    device: int | None
    detail: str
    at: datetime

    def label(self) -> str:
        parts = [self.kind.value]
        if self.xid is not None:
            parts.append(f"xid={self.xid}")
        if self.device is not None:
            parts.append(f"device={self.device}")
        if self.detail:
            parts.append(f"({self.detail})")
        return f"{' '.join(parts)} at {self.at.isoformat()}"


@dataclass(frozen=True)
class Unhealthy:
    node: NodeHealth
    signals: tuple[str, ...]


@dataclass(frozen=True)
class Recovered:
    node: NodeHealth  # as it was while quarantined
    incident: Incident
    at: datetime


@dataclass
class Changes:
    nodes: dict[str, NodeHealth] = field(default_factory=dict)
    incidents: dict[str, Incident] = field(default_factory=dict)
    unhealthy: list[Unhealthy] = field(default_factory=list)
    recovered: list[Recovered] = field(default_factory=list)
    alerts: list[str] = field(default_factory=list)  # incident ids that raise their alert
    tracks: dict[str, Track | None] = field(default_factory=dict)  # by job id; None: dropped
    stragglers: list[Straggle] = field(default_factory=list)  # nodes that just became one
    # Nodes no longer watched: their executor's inventory stopped listing them.
    dropped: set[str] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.nodes or self.incidents or self.tracks or self.dropped)


class _ByAge:
    """Ids by a moment a change moves (a node's last heartbeat, a track's oldest window),
    for a pass that wants those at or before some moment without looking at the rest.

    A heap of (moment, id) with at most one live entry per id (`_queued`: the moment of it):
    a later moment does not add one, the entry is checked against the id's moment when it
    comes out and goes back in at that moment if it moved; an earlier moment (a clock set
    back) adds one and leaves the old one stale. So the heap holds about one entry an id,
    whatever the traffic, and a pass costs the entries that came due since the last pass.
    `_out`: the ids that came out and have not moved since (no entry in the heap)."""

    def __init__(self, moments: Iterable[tuple[datetime, str]] = ()) -> None:
        self._queued = {key: at for at, key in moments}
        self._heap = [(at, key) for key, at in self._queued.items()]
        heapq.heapify(self._heap)
        self._out: set[str] = set()

    def __len__(self) -> int:
        return len(self._heap)

    def note(self, moment: datetime, key: str) -> None:
        """The id's moment is this now (or it is new)."""
        queued = self._queued.get(key)
        if queued is not None and queued <= moment:
            return  # its entry comes out first and is put back at this moment
        self._push(moment, key)

    def forget(self, key: str) -> None:
        self._out.discard(key)  # a heap entry is dropped when it comes out

    def at_or_before(self, when: datetime, moment: Callable[[str], datetime | None]) -> set[str]:
        """The ids whose moment (None: gone) is at or before `when`."""
        while self._heap and self._heap[0][0] <= when:
            at, key = heapq.heappop(self._heap)
            if self._queued.get(key) != at:
                continue  # stale: an earlier moment was queued since
            del self._queued[key]
            now = moment(key)
            if now is None:
                continue
            if now <= when:
                self._out.add(key)
            else:
                self._push(now, key)
        out = set()
        for key in self._out:
            now = moment(key)
            if now is None or key in self._queued:
                continue  # gone, or moved and queued again (note)
            if now <= when:
                out.add(key)
            else:  # moved since (or the clock went back): back in the heap
                self._push(now, key)
        self._out = out
        return set(out)

    def _push(self, moment: datetime, key: str) -> None:
        self._queued[key] = moment
        heapq.heappush(self._heap, (moment, key))


@dataclass
class HealthBook:
    """Every known node, the open incidents and the straggler detector's job tracks: the
    service's in-memory view of its store."""

    nodes: dict[str, NodeHealth] = field(default_factory=dict)
    incidents: dict[str, Incident] = field(default_factory=dict)
    tracks: dict[str, Track] = field(default_factory=dict)
    # Kept as changes are applied (`recount` after filling the dicts directly, as the store's
    # load does; a book made with them counts them itself): nodes by state, and the jobs each
    # node straggles on. Recounting the fleet for every batch of heartbeats, or walking every
    # job's track for every node that stopped straggling, cost what the fleet's size does.
    by_state: Counter[NodeState] = field(
        default_factory=Counter, init=False, compare=False, repr=False
    )
    straggling_on: dict[str, set[str]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    # For the clock's pass, which need not look at the whole fleet each second: nodes by when
    # they were last heard (`quiet`), tracks by their oldest window (`stale_tracks`), the
    # quarantined nodes and those in an incident.
    _heard: _ByAge = field(default_factory=_ByAge, init=False, compare=False, repr=False)
    _oldest: _ByAge = field(default_factory=_ByAge, init=False, compare=False, repr=False)
    quarantined: set[str] = field(default_factory=set, init=False, compare=False, repr=False)
    # Nodes holding an incident: quarantined ones, unless the store is inconsistent.
    in_incident: set[str] = field(default_factory=set, init=False, compare=False, repr=False)
    # Open straggler incidents by node: a slow report looks its node's up (all open
    # incidents were sorted for it, thousands in an outage).
    stragglers: dict[str, set[str]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        self.recount()

    def recount(self) -> None:
        self.by_state = Counter(n.state for n in self.nodes.values())
        self.straggling_on = {}
        for job_id, track in self.tracks.items():
            _index(self.straggling_on, job_id, track, add=True)
        self._heard = _ByAge((_heard(n), n.node_id) for n in self.nodes.values())
        self._oldest = _ByAge((_oldest(t), job_id) for job_id, t in self.tracks.items())
        self.quarantined = {
            n.node_id for n in self.nodes.values() if n.state is NodeState.UNHEALTHY
        }
        self.in_incident = {n.node_id for n in self.nodes.values() if n.incident_id is not None}
        self.stragglers = {}
        for inc in self.incidents.values():
            _straggler(self.stragglers, inc, add=True)

    def quiet(self, heard_by: datetime) -> set[str]:
        """Every node not heard after `heard_by` (never heard included): the only ones
        silence can change."""
        return self._heard.at_or_before(
            heard_by, lambda n: _heard(node) if (node := self.nodes.get(n)) else None
        )

    def stale_tracks(self, by: datetime) -> set[str]:
        """The jobs whose track has a window with no report after `by`: the only ones
        expiry can change."""
        return self._oldest.at_or_before(
            by, lambda j: _oldest(track) if (track := self.tracks.get(j)) else None
        )

    def apply(self, changes: Changes) -> None:
        for node in changes.nodes.values():
            old = self.nodes.get(node.node_id)
            if old is not None:
                self.by_state[old.state] -= 1
            self.by_state[node.state] += 1
            if old is None or old.last_heard != node.last_heard:
                self._heard.note(_heard(node), node.node_id)
            _flag(self.quarantined, node.node_id, node.state is NodeState.UNHEALTHY)
            _flag(self.in_incident, node.node_id, node.incident_id is not None)
        self.nodes.update(changes.nodes)
        for node_id in changes.dropped:
            gone = self.nodes.pop(node_id, None)
            if gone is not None:
                self.by_state[gone.state] -= 1
            self._heard.forget(node_id)
            self.quarantined.discard(node_id)
            self.in_incident.discard(node_id)
        for inc in changes.incidents.values():
            if inc.closed_at is None:
                self.incidents[inc.incident_id] = inc
            else:
                self.incidents.pop(inc.incident_id, None)
            _straggler(self.stragglers, inc, add=inc.closed_at is None)
        for job_id, track in changes.tracks.items():
            _index(self.straggling_on, job_id, self.tracks.get(job_id), add=False)
            if track is None:
                self.tracks.pop(job_id, None)
                self._oldest.forget(job_id)
            else:
                self.tracks[job_id] = track
                _index(self.straggling_on, job_id, track, add=True)
                self._oldest.note(_oldest(track), job_id)


_NEVER_HEARD = datetime.min.replace(tzinfo=UTC)


def _heard(node: NodeHealth) -> datetime:
    return node.last_heard if node.last_heard is not None else _NEVER_HEARD


_NEVER_STALE = datetime.max.replace(tzinfo=UTC)


def _oldest(track: Track) -> datetime:
    """When the track's least recently reported window last had a report."""
    return min((w.last_at for w in track.nodes), default=_NEVER_STALE)


def _straggler(by_node: dict[str, set[str]], inc: Incident, *, add: bool) -> None:
    """Note (or take out) an open straggler incident under its node."""
    if inc.cause != STRAGGLER or inc.node_id is None:
        return
    if add:
        by_node.setdefault(inc.node_id, set()).add(inc.incident_id)
    elif (ids := by_node.get(inc.node_id)) is not None:
        ids.discard(inc.incident_id)
        if not ids:
            del by_node[inc.node_id]


def _flag(members: set[str], node_id: str, on: bool) -> None:
    if on:
        members.add(node_id)
    else:
        members.discard(node_id)


def _index(on: dict[str, set[str]], job_id: str, track: Track | None, *, add: bool) -> None:
    """Add (or take out) the nodes `track` finds straggling, under its job."""
    if track is None:
        return
    for w in track.nodes:
        if not w.straggling:
            continue
        if add:
            on.setdefault(w.node_id, set()).add(job_id)
        elif (jobs := on.get(w.node_id)) is not None:
            jobs.discard(job_id)
            if not jobs:
                del on[w.node_id]


class Draft:
    """Changes being decided over a book: reads see earlier decisions of the same batch."""

    def __init__(self, book: HealthBook, rules: HealthRules, new_id: IdFactory) -> None:
        self.book = book
        self.rules = rules
        self.new_id = new_id
        self.changes = Changes()
        # Heartbeats and probes about nodes no executor's inventory lists: ignored, counted.
        self.unknown_signals = 0
        # The jobs each node straggles on by the tracks this draft changed, and the straggler
        # incidents it opened or changed, by node (the book's indexes have the others).
        self._straggling_on: dict[str, set[str]] = {}
        self._stragglers: dict[str, set[str]] = {}

    def node(self, node_id: str) -> NodeHealth | None:
        if node_id in self.changes.dropped:
            return self.changes.nodes.get(node_id)
        return self.changes.nodes.get(node_id) or self.book.nodes.get(node_id)

    def put(self, node: NodeHealth) -> None:
        if self.node(node.node_id) != node:
            self.changes.nodes[node.node_id] = node
            self.changes.dropped.discard(node.node_id)

    def drop(self, node_id: str) -> None:
        self.changes.nodes.pop(node_id, None)
        self.changes.dropped.add(node_id)

    def incident(self, incident_id: str | None) -> Incident | None:
        if incident_id is None:
            return None
        return self.changes.incidents.get(incident_id) or self.book.incidents.get(incident_id)

    def put_incident(self, incident: Incident) -> None:
        self.changes.incidents[incident.incident_id] = incident
        _straggler(self._stragglers, incident, add=True)

    def straggler_incident(self, node_id: str) -> Incident | None:
        """The node's open straggler incident (the first by id, as a look at every open
        incident would find it)."""
        ids = self.book.stragglers.get(node_id, set()) | self._stragglers.get(node_id, set())
        for incident_id in sorted(ids):
            inc = self.incident(incident_id)
            if inc is not None and inc.closed_at is None:  # cause and node never change
                return inc
        return None

    def all_nodes(self) -> list[NodeHealth]:
        ids = sorted({*self.book.nodes, *self.changes.nodes})
        return [n for n in (self.node(i) for i in ids) if n is not None]

    def nodes_among(self, ids: Iterable[str]) -> list[NodeHealth]:
        """These nodes and those this draft changed, as the draft has them, by id."""
        every = sorted({*ids, *self.changes.nodes})
        return [n for n in (self.node(i) for i in every) if n is not None]

    def open_incidents(self) -> list[Incident]:
        ids = sorted({*self.book.incidents, *self.changes.incidents})
        found = (self.incident(i) for i in ids)
        return [i for i in found if i is not None and i.closed_at is None]

    def track(self, job_id: str) -> Track | None:
        if job_id in self.changes.tracks:
            return self.changes.tracks[job_id]
        return self.book.tracks.get(job_id)

    def put_track(self, job_id: str, track: Track | None) -> None:
        _index(self._straggling_on, job_id, self.changes.tracks.get(job_id), add=False)
        self.changes.tracks[job_id] = track
        _index(self._straggling_on, job_id, track, add=True)

    def straggling(self, node_id: str) -> bool:
        """Whether some job's track, as this draft has it, finds the node straggling."""
        if self._straggling_on.get(node_id):
            return True
        changed = self.changes.tracks
        return any(j not in changed for j in self.book.straggling_on.get(node_id, ()))

    def tracks_among(self, job_ids: Iterable[str]) -> list[Track]:
        """These jobs' tracks and those this draft changed, as the draft has them, by job."""
        every = sorted({*job_ids, *self.changes.tracks})
        return [t for t in (self.track(i) for i in every) if t is not None]

    def open_incident(
        self,
        subject: str,
        cluster: str,
        cause: str,
        severity: Severity,
        action: str,
        *,
        now: datetime,
        count: int,
        node_id: str | None,
    ) -> Incident:
        inc = Incident(
            self.new_id(), subject, cluster, node_id, cause, severity, action, now, now, count
        )
        self.put_incident(inc)
        self.changes.alerts.append(inc.incident_id)
        return inc


def heartbeats_seen(draft: Draft, beats: Iterable[Beat]) -> None:
    """Only nodes an inventory listed are watched: a heartbeat about any other node (a
    foreign producer's, a decommissioned node's) would otherwise add a node that then goes
    dark, with an incident and an alert, and lets anyone grow the book without bound."""
    for beat in beats:
        node = draft.node(beat.node_id)
        if node is None:
            draft.unknown_signals += 1
            continue
        draft.put(machine.heartbeat(node, beat.at, draft.rules.timings))


def inventory_seen(draft: Draft, cluster: str, node_ids: Iterable[str], at: datetime) -> None:
    """Nodes an executor lists are watched from now on, even if they never heartbeat. A node
    its inventory no longer lists (an elastic pool's node removed, a Node object deleted) is
    gone, not silent: it is no longer watched, unless it is quarantined (its incident stays
    until it is back)."""
    listed = set(node_ids)
    for node_id in listed:
        if draft.node(node_id) is None:
            draft.put(NodeHealth(node_id, cluster, last_heard=at))
    for node in draft.all_nodes():
        if node.cluster != cluster or node.node_id in listed:
            continue
        if node.state is not NodeState.UNHEALTHY:
            draft.drop(node.node_id)


def probes_seen(draft: Draft, probes: Iterable[Seen], now: datetime) -> int:
    """Judge each probe; returns how many matched no rule (ignored, and counted by the shell)."""
    unmatched = 0
    for seen in probes:
        rule = draft.rules.match(seen.kind, seen.xid)
        if rule is None:
            unmatched += 1
            continue
        node = draft.node(seen.node_id)
        if node is None:  # no inventory lists it (see heartbeats_seen)
            draft.unknown_signals += 1
            continue
        signal = Signal(rule.name, seen.at, seen.label())
        node, verdict, behind = machine.probe(node, rule, signal, now)
        if verdict == Verdict.QUARANTINE:
            inc = draft.open_incident(
                node.node_id,
                node.cluster,
                rule.name,
                rule.severity,
                rule.suggested_action,
                now=now,
                count=len(behind),
                node_id=node.node_id,
            )
            node = replace(node, incident_id=inc.incident_id)
            draft.changes.unhealthy.append(Unhealthy(node, tuple(s.label for s in behind)))
        elif verdict == Verdict.COUNTED:
            counted = draft.incident(node.incident_id)
            # A cluster incident counts dark nodes, not probes.
            if counted is not None and counted.node_id is not None:
                draft.put_incident(replace(counted, count=counted.count + 1, last_seen=now))
        draft.put(node)
    return unmatched


def check(draft: Draft, now: datetime, watch_from: datetime | None) -> None:
    """The periodic pass: silence first (grouped by cluster), then recoveries. Without a
    `watch_from` (nothing consumed yet) silence is not judged: every heartbeat would look
    old to a service still joining its consumer group."""
    if watch_from is not None:
        _silences(draft, now, watch_from)
    _recoveries(draft, now)


def _silences(draft: Draft, now: datetime, watch_from: datetime) -> None:
    t = draft.rules.timings
    went_dark: dict[str, list[NodeHealth]] = {}
    # Only a node not heard for `suspect_after_s` can be judged silent (watch_from only makes
    # a silence shorter): the rest of the fleet is not looked at.
    for node in draft.nodes_among(draft.book.quiet(now - timedelta(seconds=t.suspect_after_s))):
        after, verdict = machine.silence(node, now, watch_from, t)
        if verdict == Verdict.QUARANTINE:
            went_dark.setdefault(after.cluster, []).append(after)
        else:
            draft.put(after)
    if not went_dark:
        return
    members: dict[str, list[NodeHealth]] = {}
    for node in draft.all_nodes():
        members.setdefault(node.cluster, []).append(node)
    for cluster, dark in sorted(went_dark.items()):
        inc = _cluster_incident(draft, cluster)
        all_dark = all(
            machine.silent_for(m, now, watch_from) >= t.suspect_after_s for m in members[cluster]
        )
        if inc is None and all_dark and len(members[cluster]) >= t.cluster_min_nodes:
            inc = draft.open_incident(
                cluster,
                cluster,
                HEARTBEAT_LOST,
                draft.rules.silence_severity,
                draft.rules.cluster_silence_action,
                now=now,
                count=0,
                node_id=None,
            )
        for node in dark:
            if inc is not None:  # one cluster incident: nodes join it without alerts
                inc = replace(inc, count=inc.count + 1, last_seen=now)
                draft.put_incident(inc)
                own = inc
            else:
                own = draft.open_incident(
                    node.node_id,
                    node.cluster,
                    HEARTBEAT_LOST,
                    draft.rules.silence_severity,
                    draft.rules.silence_action,
                    now=now,
                    count=1,
                    node_id=node.node_id,
                )
            node = replace(node, incident_id=own.incident_id)
            draft.put(node)
            last = node.last_heard.isoformat() if node.last_heard else "never"
            draft.changes.unhealthy.append(Unhealthy(node, (f"no heartbeat since {last}",)))


def _cluster_incident(draft: Draft, cluster: str) -> Incident | None:
    found = [
        inc for inc in draft.open_incidents() if inc.node_id is None and inc.cluster == cluster
    ]
    return max(found, key=lambda i: i.first_seen) if found else None


def _recoveries(draft: Draft, now: datetime) -> None:
    # Only a quarantined node recovers; only a node in an incident keeps one open.
    book = draft.book
    nodes = draft.nodes_among(book.quarantined | book.in_incident)
    # Nodes still in each incident, counted down as they recover: a cluster incident ends
    # with its last node. (Looking for another member at each recovery cost the square of the
    # cluster's size when a whole cluster came back: seconds at a few thousand nodes.)
    members = Counter(n.incident_id for n in nodes if n.incident_id is not None)
    for node in nodes:
        if not machine.recoverable(node, now, draft.rules):
            continue
        inc = draft.incident(node.incident_id)
        draft.put(machine.recover(node))
        if node.incident_id is not None:
            members[node.incident_id] -= 1
        if inc is None:
            # Only an inconsistent store gets here; the node still deserves to come back.
            inc = _orphan_incident(node, now)
        elif inc.node_id is not None or members[inc.incident_id] <= 0:
            # A node incident ends with its node; a cluster incident with its last node.
            inc = replace(inc, closed_at=now)
            draft.put_incident(inc)
        draft.changes.recovered.append(Recovered(node, inc, now))


def _orphan_incident(node: NodeHealth, now: datetime) -> Incident:
    since = node.quarantined_at or now
    return Incident(
        node.incident_id or "unknown",
        node.node_id,
        node.cluster,
        node.node_id,
        node.cause or "unknown",
        Severity.INFO,
        "",
        since,
        since,
        0,
        closed_at=now,
    )
