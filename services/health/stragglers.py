"""Straggler incidents, decided over a `Draft`: progress reports go through the detector
(services.health.pace), and a node that becomes a straggler opens one incident with one alert,
and, when the rules say so, a quarantine.

A straggler incident belongs to the node, not to the job: a slow node slows every gang it
runs, so a second job finding it slow only counts on the open incident. The incident ends when
no job still finds the node straggling (m reports in a row not slow, or their reports stopped);
after a straggler quarantine it ends with the node's recovery instead, like any quarantine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime, timedelta

from services.health import machine, pace
from services.health.book import Draft, Unhealthy
from services.health.machine import NodeHealth, NodeState
from services.health.pace import Progress, Straggle
from services.health.rules import STRAGGLER


def progress_seen(draft: Draft, reports: Iterable[Progress], now: datetime) -> int:
    """Judge each report; returns how many were ignored (a gang of one, an older attempt, a
    redelivery) for the shell to count."""
    ignored = 0
    for report in reports:
        seen = pace.observe(draft.track(report.job_id), report, draft.rules.straggler)
        if seen is None:
            ignored += 1
            continue
        draft.put_track(report.job_id, seen.track)
        for straggle in seen.started:
            _straggling(draft, straggle, now)
        for node_id in seen.slow_again:
            _slow_again(draft, node_id, now)
        _caught_up(draft, seen.ended, now)
    return ignored


def expired(draft: Draft, now: datetime, watch_from: datetime | None) -> None:
    """The clock's part: jobs whose reports stopped (they ended, or left a node) let go of
    their nodes. Not judged before anything was consumed, as with silence."""
    if watch_from is None:
        return
    # Only a window with no report for `expire_after_s` expires (watch_from only makes that
    # shorter): the tracks without one are not looked at.
    rules = draft.rules.straggler
    stale = draft.book.stale_tracks(now - timedelta(seconds=rules.expire_after_s))
    for track in draft.tracks_among(stale):
        after, ended = pace.expire(track, now, watch_from, rules)
        if after is not track:
            draft.put_track(track.job_id, after)
            _caught_up(draft, ended, now)


def _straggling(draft: Draft, s: Straggle, now: datetime) -> None:
    draft.changes.stragglers.append(s)
    node = draft.node(s.node_id)
    inc = draft.straggler_incident(s.node_id)
    if inc is not None:  # another job found it first: same incident, no new alert
        draft.put_incident(replace(inc, count=inc.count + s.slow_reports, last_seen=now))
        _hold_quarantine(draft, node, s.at)
        return
    if node is not None and node.state == NodeState.UNHEALTHY:
        return  # already out (and alerted) for another cause: being slow is no news
    rules = draft.rules.straggler
    inc = draft.open_incident(
        s.node_id,
        s.cluster,
        STRAGGLER,
        rules.severity,
        rules.action_for(s.node_id, s.job_id, s.replica, s.ratio),
        now=now,
        count=s.slow_reports,
        node_id=s.node_id,
    )
    if rules.quarantine:
        # The report proves the node is up, as a probe does, if no heartbeat reached us yet.
        node = node or NodeHealth(s.node_id, s.cluster, last_heard=s.at)
        sick = replace(
            machine.quarantine(node, STRAGGLER, now, bad_at=s.at), incident_id=inc.incident_id
        )
        draft.put(sick)
        draft.changes.unhealthy.append(Unhealthy(sick, (s.label(),)))


def _slow_again(draft: Draft, node_id: str, now: datetime) -> None:
    inc = draft.straggler_incident(node_id)
    if inc is not None:
        draft.put_incident(replace(inc, count=inc.count + 1, last_seen=now))
    _hold_quarantine(draft, draft.node(node_id), now)


def _hold_quarantine(draft: Draft, node: NodeHealth | None, at: datetime) -> None:
    """Still slow while out for being slow: a bad signal, so its clean period starts again."""
    if node is None or node.state != NodeState.UNHEALTHY or node.cause != STRAGGLER:
        return
    if node.last_bad_at is None or at > node.last_bad_at:
        draft.put(replace(node, last_bad_at=at))


def _caught_up(draft: Draft, node_ids: Iterable[str], now: datetime) -> None:
    for node_id in node_ids:
        if draft.straggling(node_id):
            continue  # still slow on another job
        inc = draft.straggler_incident(node_id)
        if inc is None:
            continue
        node = draft.node(node_id)
        if node is not None and node.incident_id == inc.incident_id:
            continue  # its quarantine's incident: it ends with the recovery
        draft.put_incident(replace(inc, closed_at=now))
