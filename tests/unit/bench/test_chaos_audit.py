"""The chaos audit. Its node-use rebuild must neither miss an over-commit nor invent one when
two leaders placed one attempt on different nodes and only one copy ran; it counts an event
sent twice (same id, an outbox retransmission) once, and two events for one run as two."""

from __future__ import annotations

from typing import Any

from bench.chaos import first_copies, overcommitted_nodes
from schemas import topics

CLUSTER = "onprem-h100"
N0, N1 = "onprem-h100-h100-0000", "onprem-h100-h100-0001"


def placement(job: str, node: str, epoch: int, gpus: int = 8) -> tuple[str, dict[str, Any]]:
    replicas = [{"replica": 0, "node_id": node, "accelerators": gpus, "cpu": 1, "memory_gb": 1}]
    payload = {
        "job_id": job,
        "attempt": 1,
        "epoch": epoch,
        "cluster": CLUSTER,
        "replicas": replicas,
    }
    return topics.PLACEMENT_DECIDED, {"type": "PlacementDecided", "payload": payload}


def edge(topic: str, job: str, at: str, node: str) -> tuple[str, dict[str, Any]]:
    payload = {"job_id": job, "attempt": 1, "cluster": CLUSTER, "nodes": [node]}
    return topic, {"type": "x", "occurred_at": f"2026-11-22T06:00:{at}Z", "payload": payload}


FENCE = (topics.PLACEMENT_DECIDED, {"type": topics.LEADER_FENCE, "payload": {"epoch": 2}})


def test_the_copy_that_ran_is_the_one_counted() -> None:
    events = [
        FENCE,
        placement("a", N0, epoch=1),  # the deposed leader's copy, refused
        placement("a", N1, epoch=2),
        edge(topics.JOB_STARTED, "a", "01", N1),
        placement("b", N0, epoch=2),
        edge(topics.JOB_STARTED, "b", "02", N0),
    ]
    assert overcommitted_nodes(events) == 0


def test_two_full_runs_on_one_node_at_once_are_caught() -> None:
    events = [
        placement("a", N0, epoch=2),
        edge(topics.JOB_STARTED, "a", "01", N0),
        placement("b", N0, epoch=2),
        edge(topics.JOB_STARTED, "b", "02", N0),
    ]
    assert overcommitted_nodes(events) == 1
    ended = [*events[:2], edge(topics.JOB_FINISHED, "a", "01.5", N0), *events[2:]]
    assert overcommitted_nodes(ended) == 0


def test_a_retransmission_is_one_event_and_two_ids_are_two() -> None:
    a = ("job.finished", {"event_id": "e1", "payload": {"job_id": "j", "attempt": 1}})
    again = ("job.finished", {"event_id": "e1", "payload": {"job_id": "j", "attempt": 1}})
    other = ("job.finished", {"event_id": "e2", "payload": {"job_id": "j", "attempt": 1}})
    assert first_copies([a, again]) == [a]
    assert first_copies([a, again, other]) == [a, other]
    no_id = ("job.finished", {"payload": {"job_id": "k"}})
    assert first_copies([no_id, no_id]) == [no_id, no_id]  # nothing to tell them apart by
