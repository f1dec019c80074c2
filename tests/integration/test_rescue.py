"""Beat's rescue on Redis, against real Redis and MariaDB: a lease in a message a dead
consumer fetched is handed back once its run lock stayed free, one a live run holds is
not; under a canary, a dead new-side run falls back (``bridge.runtime.rescue``)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping

import pytest
from celery import Celery
from redis_databases import REDIS_DATABASES
from services import url_of
from sqlalchemy import Engine, select

from bridge.canary.guard import read_window
from bridge.canary.weights import bucket, canary_of
from bridge.config import load_settings
from bridge.engine.context import FixedCanary, Runtime
from bridge.handlers.phabricator import PhabricatorTestWorker
from bridge.handlers.registry import Registry
from bridge.queue import Lease, PhorgeQueue, make_engine
from bridge.queue.implementations import CELERY
from bridge.queue.model import Leased, NewTask
from bridge.queue.run_locks import RunLocks
from bridge.queue.schema import worker_activetask as active
from bridge.runtime.dispatch import EXECUTE_BATCH, EXECUTE_TASK, send_messages
from bridge.runtime.rescue import FREE_FOR, Rescuer, fetched_leases

pytestmark = [pytest.mark.mariadb, pytest.mark.redis]

CLASS = "PhabricatorTestWorker"
QUEUE = "rescue-test"

# A consumer that fetches every message of the queue, acks none, and dies (kill -9 has
# the same effect: no channel close, so kombu restores nothing).
FETCH_AND_DIE = textwrap.dedent(
    """
    import os, sys
    from kombu import Connection, Queue
    with Connection(sys.argv[1]) as conn:
        queue = conn.SimpleQueue(Queue(sys.argv[2], routing_key=sys.argv[2]))
        for _ in range(int(sys.argv[3])):
            queue.get(timeout=10)
        os._exit(0)
    """
)


@pytest.fixture
def broker(redis_url: str) -> Iterator[str]:
    server = redis_url.rstrip("/")
    number = REDIS_DATABASES.claim(server)
    yield f"{server}/{number}"
    REDIS_DATABASES.release(server, number)


@pytest.fixture
def queue(mysql_engine: Engine) -> Iterator[PhorgeQueue]:
    phorge = PhorgeQueue(make_engine(url_of(mysql_engine)))
    yield phorge
    phorge.engine.dispose()


@pytest.fixture
def rt(broker: str, queue: PhorgeQueue) -> Iterator[Runtime]:
    """The runtime whose registry and weights the rescue decides by (beat's own)."""
    settings = load_settings(
        {"BRIDGE_DATABASE_URL": url_of(queue.engine), "BRIDGE_BROKER_URL": broker}
    )
    runtime = Runtime(settings, queue, Registry([PhabricatorTestWorker()]))
    yield runtime
    runtime.runs.close()


def test_a_dead_consumer_s_leases_are_handed_back_and_a_live_run_s_are_not(
    broker: str, queue: PhorgeQueue, rt: Runtime
) -> None:
    queue.enqueue_many([NewTask(CLASS, {}) for _ in range(4)])
    owner, items = queue.lease_to_send(4, "bridge", 300, [CLASS], 1024)
    dead, running, in_batch, also_in_batch = items
    app = Celery(broker=broker)
    app.conf.task_default_queue = QUEUE
    app.send_task(EXECUTE_TASK, (dead.id, owner, dead.failure_count))
    app.send_task(EXECUTE_TASK, (running.id, owner, running.failure_count))
    app.send_task(EXECUTE_BATCH, (owner, [list(in_batch), list(also_in_batch)]))
    app.send_task("bridge.poll")  # not an execute message: no lease of it
    subprocess.run([sys.executable, "-c", FETCH_AND_DIE, broker, QUEUE, "4"], check=True)

    with app.connection_for_read() as conn:
        fetched = fetched_leases(conn.default_channel)
    leases = {item.id: Lease(item.id, owner, item.failure_count) for item in items}
    assert sorted(fetched) == sorted(leases.values())

    live = RunLocks(queue.engine)  # the run of ``running`` goes on in another process
    live.hold([leases[running.id]])
    rescuer = Rescuer(app, queue.engine, lambda: rt)
    try:
        assert rescuer.look(fetched, now=0.0) == [], "a lock free for a moment is no death"
        handed = rescuer.look(fetched, now=FREE_FOR)
        assert sorted(handed) == sorted([dead.id, in_batch.id, also_in_batch.id])
        with queue.engine.connect() as c:
            rows = {row.id: row.leaseOwner for row in c.execute(select(active))}
        assert rows[running.id] == owner, "a live run keeps its lease"
        assert {rows[i] for i in handed} == {None}, "due again at once, for a new lease"
        assert rescuer.look(fetched, now=2 * FREE_FOR) == [], "handed back once"
        live.release([leases[running.id]])  # its process died after all
        assert rescuer.look(fetched, now=2 * FREE_FOR + 1) == []
        assert rescuer.look(fetched, now=3 * FREE_FOR + 1) == [running.id]
    finally:
        live.close()
        rescuer.stop()


def looked_twice(
    rescuer: Rescuer, fetched: Mapping[Lease, Leased], caplog: pytest.LogCaptureFixture
) -> list[int]:
    """The rescuer's look at once (a lock free for a moment is no death) and
    ``FREE_FOR`` later, which hands back; the ids handed back, its warnings captured."""
    try:
        assert rescuer.look(fetched, now=0.0) == []
        with caplog.at_level(logging.WARNING, logger="bridge.runtime.rescue"):
            return rescuer.look(fetched, now=FREE_FOR)
    finally:
        rescuer.stop()


def test_a_dead_consumer_s_new_side_runs_of_a_shared_class_fall_back(
    broker: str, queue: PhorgeQueue, rt: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    """Shared at 50% with phd, the leases of messages sent as the poll sends them (single
    and batched) fall back for the bridge's share, as a redelivered copy's do (failureTime
    set, no failure counted, a new-side fallback in the guard's window); phd's share (a
    rollback sent it there meanwhile) is handed back; a live new-side run is left alone."""
    queue.enqueue_many([NewTask(CLASS, {}) for _ in range(12)])
    owner, items = queue.lease_to_send(12, "bridge", 300, [CLASS], 1024)
    rt.canary = FixedCanary(canary_of({CLASS: {"celery": 50}}, None))
    ours = {item.id for item in items if bucket(CELERY, item.id) < 5000}
    assert 0 < len(ours) < len(items)
    live = next(item for item in items if item.id in ours)
    app = Celery(broker=broker)
    app.conf.task_default_queue = QUEUE
    singles = send_messages(app, owner, items[:4], QUEUE, 1)
    batches = send_messages(app, owner, items[4:], QUEUE, 4)
    assert [len(m.tasks) for m in singles + batches] == [1, 1, 1, 1, 4, 4]
    subprocess.run([sys.executable, "-c", FETCH_AND_DIE, broker, QUEUE, "6"], check=True)

    with app.connection_for_read() as conn:
        fetched = fetched_leases(conn.default_channel)
    assert {lease.task_id: item.task_class for lease, item in fetched.items()} == dict.fromkeys(
        [item.id for item in items], CLASS
    ), "each lease with its class, as its message names it"

    running = RunLocks(queue.engine)  # one new-side run goes on in another process
    running.hold([Lease(live.id, owner, live.failure_count)])
    try:
        handed = looked_twice(Rescuer(app, queue.engine, lambda: rt), fetched, caplog)
    finally:
        running.close()
    assert sorted(handed) == sorted(item.id for item in items if item.id != live.id)
    fell = ours - {live.id}
    assert f"{len(fell)} fallen back to the old side" in caplog.text
    with queue.engine.connect() as c:
        rows = {row.id: row for row in c.execute(select(active))}
    assert rows[live.id].leaseOwner == owner and rows[live.id].failureTime is None
    for task_id in handed:
        row = rows[task_id]
        assert row.leaseOwner is None and row.failureCount == 0
        assert (row.failureTime is not None) == (task_id in fell), task_id
    window = read_window(queue.engine, CLASS, CELERY, 300, 2000)
    assert (window.new.runs, window.new.fallbacks) == (len(fell), len(fell))


def test_without_a_runtime_to_tell_fallbacks_a_dead_consumer_s_leases_are_still_handed_back(
    broker: str, queue: PhorgeQueue, caplog: pytest.LogCaptureFixture
) -> None:
    """Beat's runtime cannot be built (a handler that does not import, say): its rescue
    still hands the dead consumer's leases back, as before the canary, and says why
    none fell back."""
    queue.enqueue_many([NewTask(CLASS, {}) for _ in range(2)])
    owner, items = queue.lease_to_send(2, "bridge", 300, [CLASS], 1024)
    app = Celery(broker=broker)
    app.conf.task_default_queue = QUEUE
    send_messages(app, owner, items, QUEUE, 1)
    subprocess.run([sys.executable, "-c", FETCH_AND_DIE, broker, QUEUE, "2"], check=True)

    def broken() -> Runtime:
        raise ImportError("no module named 'handlers_of_ours'")

    with app.connection_for_read() as conn:
        fetched = fetched_leases(conn.default_channel)
    handed = looked_twice(Rescuer(app, queue.engine, broken), fetched, caplog)
    assert sorted(handed) == sorted(item.id for item in items)
    assert "handed back without fallbacks (no runtime to tell): no module named" in caplog.text
    with queue.engine.connect() as c:
        rows = list(c.execute(select(active)))
    assert all(row.leaseOwner is None and row.failureTime is None for row in rows)
