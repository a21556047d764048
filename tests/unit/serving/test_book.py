"""The serving service's books without I/O: a service declared gets its minimum replicas as
jobs, replicas that report ready become endpoints, load scales it, a new version rolls out a
few at a time, a failing version rolls back by itself, a lost replica waits again and a failed
one is replaced."""

from __future__ import annotations

import itertools

from core.serving import ReplicaState
from schemas.job import Resources
from schemas.serving import ReplicaReported, ServiceAction, ServiceCommand, ServiceSpec
from services.serving.book import Book, Refused

T0 = 1_000_000.0


def spec(**over: object) -> ServiceSpec:
    base: dict[str, object] = {
        "name": "chat",
        "tenant": "vision",
        "model": "llama",
        "version": "v1",
        "resources": Resources(accelerators=0.5, cpu=2, memory_gb=8),
        "min_replicas": 2,
        "max_replicas": 6,
        "target_rps": 10.0,
        "latency_slo_ms": 200.0,
        "scale_down_after_s": 60.0,
    }
    return ServiceSpec.model_validate({**base, **over})


def started(book: Book, job_id: str, now: float) -> None:
    """The replica's agent (its executor) says it runs, not ready yet."""
    report = ReplicaReported(
        service="chat", replica=job_id, ready=False, cluster="onprem", node=f"n-{job_id}"
    )
    book.report(report, now, now)


def run_all(book: Book, now: float) -> None:
    """Every replica starts and reports ready (again: the agent reports every few seconds)."""
    for rep in list(book.replicas.values()):
        if rep.live:
            started(book, rep.job_id, now)
            ready = ReplicaReported(
                service=rep.service, replica=rep.job_id, ready=True, address=f"{rep.job_id}:80"
            )
            book.report(ready, now, now)


def live(book: Book, version: str | None = None) -> list[str]:
    return sorted(
        r.job_id
        for r in book.replicas.values()
        if r.live and (version is None or r.version == version)
    )


def test_declared_service_gets_guaranteed_minimum_and_endpoints() -> None:
    book = Book()
    book.declare(spec(), T0)
    out = book.round(T0)
    assert [s.job_id for s in out.submit] == ["svc-chat-1", "svc-chat-2"]
    assert all(not s.preemptible and s.priority_class == "high" for s in out.submit)
    assert out.submit[0].labels["qm_service"] == "chat"
    assert out.submit[0].retry.max_retries == 0
    assert out.statuses and out.statuses[-1].endpoints == []
    run_all(book, T0 + 1)
    status = book.round(T0 + 1).statuses[-1]
    assert status.ready_replicas == 2
    assert sorted(e.address for e in status.endpoints) == ["svc-chat-1:80", "svc-chat-2:80"]
    # Nothing changed: nothing published.
    assert book.round(T0 + 2).statuses == []


def test_load_scales_up_at_once_and_down_after_the_quiet_window() -> None:
    book = Book()
    book.declare(spec(), T0)
    book.round(T0)
    run_all(book, T0)
    for i, job in enumerate(live(book)):
        book.report(
            ReplicaReported(service="chat", replica=job, rps=25.0, latency_ms=50.0),
            T0 + 1 + i,
            T0 + 2,
        )
    out = book.round(T0 + 2)
    assert len(out.submit) == 3  # 50 rps at 10 each: 5 replicas
    assert all(s.preemptible for s in out.submit)  # above the minimum
    assert book.services["chat"].desired == 5
    run_all(book, T0 + 3)
    # The load drops; replicas go only after the window, to 80 % headroom.
    guaranteed = {j: book.replicas[j].guaranteed for j in live(book)}
    stopped: set[str] = set()
    for t in range(4, 80, 5):
        run_all(book, T0 + t)
        for job in live(book):
            book.report(
                ReplicaReported(service="chat", replica=job, rps=2.0, latency_ms=40.0),
                T0 + t,
                T0 + t,
            )
        out = book.round(T0 + t)
        if t < 60:
            assert out.stop == []
        stopped |= {job for job, _, _ in out.stop}
    assert book.services["chat"].desired == 2
    assert len(stopped) == 3 and len(live(book)) == 2
    assert all(guaranteed[j] is False for j in stopped)


def test_rollout_replaces_replicas_a_few_at_a_time_and_completes() -> None:
    book = Book()
    book.declare(spec(min_replicas=3, max_replicas=3), T0)
    book.round(T0)
    run_all(book, T0)
    book.round(T0)
    book.declare(spec(min_replicas=3, max_replicas=3, version="v2"), T0 + 10)
    now = T0 + 10
    for _ in range(20):
        out = book.round(now)
        # Never fewer than 3 ready, never more than 4 live.
        ready = [r for r in book.replicas.values() if r.state is ReplicaState.READY and r.live]
        assert len(ready) >= 3 or not out.stop
        assert len(live(book)) <= 4
        run_all(book, now + 1)
        now += 2
        if book.services["chat"].rollout_from is None:
            break
    assert book.services["chat"].rollout_from is None
    assert book.services["chat"].change == "rollout_done"
    assert len(live(book, "v2")) == 3 and live(book, "v1") == []


def test_failing_version_rolls_back_by_itself() -> None:
    book = Book()
    book.declare(spec(min_replicas=2, max_replicas=2), T0)
    book.round(T0)
    run_all(book, T0)
    book.round(T0)
    book.declare(spec(min_replicas=2, max_replicas=2, version="v2"), T0 + 10)
    out = book.round(T0 + 10)
    (new,) = [s.job_id for s in out.submit]
    started(book, new, T0 + 11)
    book.ended(new, failed=True, now=T0 + 12)
    out = book.round(T0 + 12)
    rec = book.services["chat"]
    assert rec.change == "rollback_started" and rec.rolling_back
    assert rec.spec.version == "v1" and "failed" in rec.reason
    for _ in range(5):
        book.round(T0 + 13)
    assert rec.rollout_from is None and rec.change == "rolled_back"
    assert len(live(book, "v1")) == 2
    # The way forward again is an undo (back to v2).
    book.command(
        ServiceCommand(service="chat", tenant="vision", action=ServiceAction.UNDO), T0 + 20
    )
    assert rec.spec.version == "v2" and rec.rollout_from == "v1"


def test_lost_replica_waits_again_and_failed_one_is_replaced() -> None:
    book = Book()
    book.declare(spec(), T0)
    book.round(T0)
    run_all(book, T0)
    book.round(T0)
    first, second = live(book)
    book.preempted(first, 0, T0 + 5)
    assert book.replicas[first].state is ReplicaState.PENDING
    assert book.replicas[first].address is None
    assert book.round(T0 + 5).submit == []  # the queue requeues it: no new job
    book.ended(second, failed=True, now=T0 + 6)
    assert book.round(T0 + 6).submit == []  # the first replacement waits 2 s
    out = book.round(T0 + 8)
    assert [s.job_id for s in out.submit] == ["svc-chat-3"]
    assert not out.submit[0].preemptible  # it replaces a guaranteed replica


def test_refusals_name_the_cause() -> None:
    book = Book()
    book.declare(spec(), T0)
    try:
        book.declare(spec(tenant="nlp"), T0)
        raise AssertionError("another tenant took the name")
    except Refused as error:
        assert "another tenant" in str(error)
    try:
        book.declare(spec(image="other:1"), T0)
        raise AssertionError("a new template kept its version")
    except Refused as error:
        assert "new version" in str(error)
    try:
        book.command(ServiceCommand(service="chat", tenant="nlp", action=ServiceAction.DELETE), T0)
        raise AssertionError("another tenant deleted it")
    except Refused:
        pass


def test_delete_stops_every_replica_and_frees_the_name() -> None:
    book = Book()
    book.declare(spec(), T0)
    book.round(T0)
    book.command(
        ServiceCommand(service="chat", tenant="vision", action=ServiceAction.DELETE), T0 + 1
    )
    out = book.round(T0 + 1)
    assert sorted(j for j, _, _ in out.stop) == ["svc-chat-1", "svc-chat-2"]
    assert out.statuses[-1].phase.value == "deleted"
    book.declare(spec(tenant="nlp"), T0 + 2)
    assert book.round(T0 + 2).submit[0].job_id == "svc-chat-3"


def test_replicas_that_keep_failing_are_replaced_with_backoff_and_the_reason() -> None:
    book = Book()
    book.declare(spec(min_replicas=1, max_replicas=1), T0)
    submitted: list[float] = []
    now = T0
    for _ in range(120):
        out = book.round(now)
        for job in out.submit:
            submitted.append(now)
            # The queue refuses it at once (e.g. a class the policy does not know).
            book.ended(job.job_id, failed=True, now=now, why="unknown_priority_class: no 'x'")
        now += 1.0
    gaps = [b - a for a, b in itertools.pairwise(submitted)]
    assert len(submitted) <= 8, submitted  # 2, 4, 8, 16, 32, 64 s apart: not one a second
    assert gaps == sorted(gaps) and gaps[-1] >= 32, gaps
    rec = book.services["chat"]
    assert rec.change == "replica_failed" and "unknown_priority_class" in rec.reason
    # One that comes up resets the backoff.
    out = book.round(now + 300)
    (job,) = out.submit
    started(book, job.job_id, now + 301)
    book.report(
        ReplicaReported(service="chat", replica=job.job_id, ready=True, address="a:1"),
        now + 301,
        now + 301,
    )
    assert rec.failures == 0 and rec.retry_at == 0.0


def test_a_replica_its_agent_stops_reporting_is_failed_stopped_and_replaced() -> None:
    book = Book(silent_after_s=20)
    book.declare(spec(min_replicas=2, max_replicas=2), T0)
    book.round(T0)
    run_all(book, T0)
    first, second = live(book)
    for t in range(1, 30):
        # Only the second one's executor still reports it.
        book.report(ReplicaReported(service="chat", replica=second, ready=True), T0 + t, T0 + t)
        out = book.round(T0 + t)
        if (first, "vision", "its agent stopped reporting it") in out.stop:
            break
    else:
        raise AssertionError("the silent replica was never given up")
    assert t == 21 and book.replicas[first].state is ReplicaState.FAILED
    assert "not reported for 21 s" in book.services["chat"].reason
    out = book.round(T0 + 40)  # after its backoff, a replacement
    assert [j.job_id for j in out.submit] == ["svc-chat-3"] and not out.submit[0].preemptible


def test_a_report_of_an_earlier_attempt_is_ignored() -> None:
    book = Book()
    book.declare(spec(), T0)
    book.round(T0)
    run_all(book, T0)
    job = live(book)[0]
    book.preempted(job, 0, T0 + 1)  # requeued: attempt 1 comes next
    late = ReplicaReported(service="chat", replica=job, attempt=0, ready=True, address="old:1")
    book.report(late, T0 + 2, T0 + 2)
    assert book.replicas[job].state is ReplicaState.PENDING
    fresh = ReplicaReported(service="chat", replica=job, attempt=1, ready=True, address="new:1")
    book.report(fresh, T0 + 3, T0 + 3)
    assert book.replicas[job].state is ReplicaState.READY
    assert book.replicas[job].address == "new:1"


def roll_to(book: Book, version: str, now: float, **over: object) -> None:
    book.declare(spec(min_replicas=2, max_replicas=2, version=version, **over), now)


def fail_new(book: Book, version: str, now: float) -> None:
    for rep in list(book.replicas.values()):
        if rep.live and rep.version == version:
            started(book, rep.job_id, now)
            book.ended(rep.job_id, failed=True, now=now)


def test_a_failure_on_the_way_back_does_not_wedge_the_service() -> None:
    book = Book()
    book.declare(spec(min_replicas=2, max_replicas=2), T0)
    book.round(T0)
    run_all(book, T0)
    book.round(T0)
    roll_to(book, "v2", T0 + 10)
    book.round(T0 + 10)
    fail_new(book, "v2", T0 + 11)
    book.round(T0 + 11)  # rolls back to v1
    rec = book.services["chat"]
    assert rec.rolling_back and rec.spec.version == "v1"
    # On the way back a v1 replica fails too (a node, a fluke).
    v1 = [r for r in book.replicas.values() if r.live and r.version == "v1"]
    book.ended(v1[0].job_id, failed=True, now=T0 + 12)
    now = T0 + 12
    for _ in range(400):
        book.round(now)
        run_all(book, now)
        now += 1
    assert rec.rollout_from is None
    assert len(live(book, "v1")) == 2 and live(book, "v2") == []
    ready = [r for r in book.replicas.values() if r.live and r.state is ReplicaState.READY]
    assert len(ready) == 2 and all(r.guaranteed for r in ready)


def test_a_new_version_declared_during_a_roll_back_returns_to_the_good_one() -> None:
    book = Book()
    book.declare(spec(min_replicas=2, max_replicas=2), T0)
    book.round(T0)
    run_all(book, T0)
    roll_to(book, "v2", T0 + 10)
    book.round(T0 + 10)
    fail_new(book, "v2", T0 + 11)
    book.round(T0 + 11)
    assert book.services["chat"].rolling_back
    roll_to(book, "v3", T0 + 12)
    assert book.services["chat"].previous is not None
    assert book.services["chat"].previous.version == "v1"  # not the failed v2


def test_a_paused_update_still_replaces_and_scales_with_the_old_version() -> None:
    book = Book()
    book.declare(spec(min_replicas=2, max_replicas=4), T0)
    book.round(T0)
    run_all(book, T0)
    book.declare(spec(min_replicas=2, max_replicas=4, version="v2"), T0 + 1)
    book.command(
        ServiceCommand(service="chat", tenant="vision", action=ServiceAction.PAUSE), T0 + 1
    )
    old = live(book, "v1")
    book.ended(old[0], failed=True, now=T0 + 2)
    out = book.round(T0 + 10)
    assert [(j.labels["qm_version"], j.preemptible) for j in out.submit] == [("v1", False)]


def test_scaling_down_keeps_the_guaranteed_minimum() -> None:
    book = Book()
    book.declare(spec(min_replicas=2, max_replicas=4), T0)
    book.round(T0)
    run_all(book, T0)
    book.command(
        ServiceCommand(service="chat", tenant="vision", action=ServiceAction.SCALE, min_replicas=4),
        T0 + 1,
    )
    book.round(T0 + 1)  # two more guaranteed replicas
    run_all(book, T0 + 2)
    book.command(
        ServiceCommand(service="chat", tenant="vision", action=ServiceAction.SCALE, min_replicas=2),
        T0 + 3,
    )
    # Load calls for 3: one goes, and the two guaranteed of the minimum stay guaranteed.
    book.services["chat"].desired = 3
    out = book.round(T0 + 3)
    assert len(out.stop) == 1
    assert sum(1 for r in book.replicas.values() if r.live and r.guaranteed) >= 2


def test_replicas_failing_together_count_once_and_the_backoff_never_overflows() -> None:
    book = Book(silent_after_s=20)
    book.declare(spec(min_replicas=10, max_replicas=10), T0)
    book.round(T0)
    run_all(book, T0)
    for job in live(book):
        book.ended(job, failed=True, now=T0 + 1)
    rec = book.services["chat"]
    assert rec.failures == 1 and rec.retry_at == T0 + 3
    # Refused for days on end: the count grows, the wait stays at the cap (2.0 ** 5000 would
    # raise OverflowError).
    rec.failures = 5000
    out = book.round(T0 + 400)
    (job,) = out.submit[:1]
    book.ended(job.job_id, failed=True, now=T0 + 401)
    assert rec.failures == 5001 and rec.retry_at == T0 + 401 + 300
