"""The queue's gauges per served Celery queue, read at scrape time, on SQLite and MariaDB:
due rows apart from dispatched ones, each with its oldest's age, unserved classes left out,
and under a canary only the bridge's share (phd's apart, per class).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import update

from bridge.canary.weights import bucket, canary_of
from bridge.engine.context import FixedCanary
from bridge.handlers.api import Handler, TaskContext
from bridge.handlers.registry import Registry
from bridge.metrics.queue import QueueCollector
from bridge.queue import PhorgeQueue, make_engine
from bridge.queue.beat_lock import BeatLock
from bridge.queue.implementations import CELERY
from bridge.queue.model import NewTask
from bridge.queue.schema import worker_activetask as active
from bridge.routing import Router

SEARCH, MAIL, UNSERVED = "SearchWorker", "MailWorker", "OnlyPhpWorker"


class Noop(Handler):
    task_classes = (SEARCH, MAIL)

    def run(self, task: TaskContext) -> None:
        pass


@pytest.fixture
def queue(engine) -> Iterator[PhorgeQueue]:
    queue = PhorgeQueue(make_engine(engine.url.render_as_string(hide_password=False)))
    yield queue
    queue.engine.dispose()


def age(queue: PhorgeQueue, task_id: int, **columns: int | str) -> None:
    with queue.engine.begin() as conn:
        conn.execute(update(active).where(active.c.id == task_id).values(**columns))


def test_due_and_dispatched_rows_are_apart_per_served_queue(queue):
    now = queue.server_time()
    old_search, _, leased = queue.enqueue_many([NewTask(SEARCH)] * 3)
    queue.enqueue_many([NewTask(SEARCH, delay_until=now + 600)])
    [unserved] = queue.enqueue_many([NewTask(UNSERVED)])
    age(queue, old_search, dateCreated=now - 100)
    age(queue, unserved, dateCreated=now - 900)  # PHP's: never in the bridge's figures
    [task] = queue.lease(1, 60, ids=[leased])
    age(queue, task.id, leaseOwner=f"bridge:1:{now - 40}:host:1")  # leased 40 s ago
    registry = CollectorRegistry()
    collector = QueueCollector(queue, Registry([Noop()]), Router(((SEARCH, "search"),), "phorge"))
    registry.register(collector)

    def value(name: str, queue_name: str) -> float | None:
        return registry.get_sample_value(name, {"queue": queue_name})

    assert value("phorge_bridge_queue_due_tasks", "search") == 2  # not the delayed one
    assert 100 <= value("phorge_bridge_oldest_due_seconds", "search") <= 102
    assert value("phorge_bridge_queue_dispatched_tasks", "search") == 1
    assert 40 <= value("phorge_bridge_oldest_dispatched_seconds", "search") <= 42
    for name in ("due_tasks", "dispatched_tasks"):
        assert value(f"phorge_bridge_queue_{name}", "phorge") == 0  # idle, still a series
    assert value("phorge_bridge_oldest_due_seconds", "phorge") == 0
    state = {"task_class": UNSERVED, "state": "queued"}
    assert registry.get_sample_value("phorge_bridge_queue_tasks", state) == 1


@pytest.mark.mariadb
def test_the_beat_gauge_says_whether_a_beat_sends_the_polls(mysql_engine):
    queue = PhorgeQueue(mysql_engine)
    registry = CollectorRegistry()
    registry.register(QueueCollector(queue, Registry([Noop()]), Router((), "phorge")))
    assert registry.get_sample_value("phorge_bridge_beat_running") == 0
    lock = BeatLock(mysql_engine, "bridge")
    try:
        assert lock.held()
        assert registry.get_sample_value("phorge_bridge_beat_running") == 1
    finally:
        lock.close()
    assert registry.get_sample_value("phorge_bridge_beat_running") == 0


def test_a_queue_shows_its_pace_and_the_rows_other_workers_serve(queue):
    """What a scaler needs: the throughput of one busy slot and the slots in use, from
    the archive; and, on a worker without PHP, the due rows the PHP workers serve."""
    queue.enqueue_many([NewTask(SEARCH)] * 5)  # one left due: a backlog being drained
    for task in queue.lease(4, 60, classes=[SEARCH]):
        assert queue.session.complete(task.lease, 500_000)  # runs of 0.5 s, just archived
    [unserved] = queue.enqueue_many([NewTask(UNSERVED)])
    registry = CollectorRegistry()
    router = Router(((SEARCH, "search"),), "phorge")
    collector = QueueCollector(queue, Registry([Noop()]), router, fleet=lambda c: c == UNSERVED)
    registry.register(collector)

    def value(name: str, queue_name: str) -> float | None:
        return registry.get_sample_value(name, {"queue": queue_name})

    assert value("phorge_bridge_queue_throughput_per_slot", "search") == 2.0
    assert 1.0 <= value("phorge_bridge_queue_busy_slots", "search") <= 2.0  # 4 runs in 1-2 s
    assert value("phorge_bridge_queue_throughput_per_slot", "phorge") == 0  # no recent runs
    assert value("phorge_bridge_queue_due_tasks", "phorge") == 1, f"#{unserved} not counted"


def test_under_a_canary_the_queue_counts_only_the_bridges_share(queue):
    """Search shared at 50%, mail wholly phd's ("*" at 0): the queue's gauges count the
    rows the bridge's poll would lease, the same hash; phd's share is served per class."""
    searches = queue.enqueue_many([NewTask(SEARCH)] * 40)
    mails = queue.enqueue_many([NewTask(MAIL)] * 3)
    now = queue.server_time()
    age(queue, mails[0], dateCreated=now - 700)
    failed = next(i for i in searches if bucket(CELERY, i) < 5000)
    age(queue, failed, failureTime=now - 5)  # failed once: phd's for good
    canary = canary_of({"*": {"celery": 0}, SEARCH: {"celery": 50}}, None)
    registry = CollectorRegistry()
    router = Router(((SEARCH, "search"), (MAIL, "mail")), "phorge")
    registry.register(QueueCollector(queue, Registry([Noop()]), router, canary=FixedCanary(canary)))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    ours = [i for i in searches if bucket(CELERY, i) < 5000 and i != failed]
    assert 0 < len(ours) < 40
    assert value("phorge_bridge_queue_due_tasks", queue="search") == len(ours)
    assert value("phorge_bridge_queue_due_tasks", queue="mail") == 0
    assert value("phorge_bridge_phd_share_due_tasks", task_class=SEARCH) == 40 - len(ours)
    assert value("phorge_bridge_phd_share_due_tasks", task_class=MAIL) == 3
    assert 700 <= value("phorge_bridge_phd_share_oldest_due_seconds", task_class=MAIL) <= 702
    # The rows themselves are counted whole, by class and state, as before.
    assert value("phorge_bridge_queue_tasks", task_class=SEARCH, state="queued") == 40
    # Without a canary, there is no phd share at all.
    plain = CollectorRegistry()
    plain.register(QueueCollector(queue, Registry([Noop()]), router))
    assert plain.get_sample_value("phorge_bridge_queue_due_tasks", {"queue": "search"}) == 40
    assert plain.get_sample_value("phorge_bridge_phd_share_due_tasks", {"task_class": MAIL}) is None
