"""Beat's rescue on Redis, against real Redis and MariaDB: a lease in a message a dead
consumer fetched is handed back once its run lock stayed free, one a live run holds is
not (``bridge.runtime.rescue``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from celery import Celery
from redis_databases import REDIS_DATABASES
from services import url_of
from sqlalchemy import Engine, select

from bridge.queue import Lease, PhorgeQueue, make_engine
from bridge.queue.model import NewTask
from bridge.queue.run_locks import RunLocks
from bridge.queue.schema import worker_activetask as active
from bridge.runtime.dispatch import EXECUTE_BATCH, EXECUTE_TASK
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


def test_a_dead_consumer_s_leases_are_handed_back_and_a_live_run_s_are_not(
    broker: str, queue: PhorgeQueue
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
    rescuer = Rescuer(app, queue.engine)
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
