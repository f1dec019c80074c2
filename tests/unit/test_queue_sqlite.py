"""PhorgeQueue on SQLite, the embedded default: several workers (engines) on one file.

Each thread gets its own engine from ``make_engine``, as separate processes would.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
from sqlalchemy import select, update
from threads import run_together

from bridge.queue import PhorgeQueue, make_engine
from bridge.queue.model import NewTask
from bridge.queue.schema import lisk_counter
from bridge.queue.schema import worker_activetask as active

WORKER = "PhabricatorTestWorker"


@pytest.fixture
def url(sqlite_engine) -> str:
    return sqlite_engine.url.render_as_string(hide_password=False)


@pytest.fixture
def queues(url):
    """A factory of queues on the same file, each with its own engine; disposed after."""
    made: list[PhorgeQueue] = []

    def make() -> PhorgeQueue:
        made.append(PhorgeQueue(make_engine(url)))
        return made[-1]

    yield make
    for queue in made:
        queue.engine.dispose()


def test_the_clock_is_epoch_seconds(queues):
    assert abs(queues().server_time() - time.time()) < 2


def test_concurrent_enqueuers_get_unique_ids_from_the_counter(queues):
    def enqueuer(queue: PhorgeQueue, name: str):
        ids = [queue.enqueue(WORKER, {"by": name, "n": n}) for n in range(15)]
        return ids + queue.enqueue_many([NewTask(WORKER, {"by": name}) for _ in range(5)])

    results = run_together(*[partial(enqueuer, queues(), f"w{n}") for n in range(4)])

    ids = [task_id for result in results for task_id in result]
    with queues().engine.connect() as conn:
        last = conn.execute(select(lisk_counter.c.counterValue)).scalar_one()
    assert sorted(ids) == list(range(1, last + 1)) and len(ids) == 80


def test_concurrent_leasers_never_win_the_same_row(queues):
    ids = queues().enqueue_many([NewTask(WORKER, {"n": n}) for n in range(300)])

    def leaser(queue: PhorgeQueue):
        won = []
        while tasks := queue.lease(10, 600, owner_prefix="leaser"):
            owners = {t.lease_owner for t in tasks}
            assert len(owners) == 1, owners  # one lease, one owner
            won += [(t.id, t.lease_owner) for t in tasks]
        return won

    leases = [
        pair
        for result in run_together(*[partial(leaser, queues()) for _ in range(4)])
        for pair in result
    ]

    leased_ids = [task_id for task_id, _ in leases]
    assert len(leased_ids) == len(set(leased_ids))
    # SQLite runs one writer at a time: a leaser finding nothing means nothing is left.
    assert sorted(leased_ids) == ids
    with queues().engine.connect() as conn:
        assert dict(conn.execute(select(active.c.id, active.c.leaseOwner)).all()) == dict(leases)


def test_a_reader_is_not_blocked_by_an_open_write_transaction(queues):
    # WAL is there so the poller, stats and the CLI can read beside one writer.
    writer, reader = queues(), queues()
    task_id = writer.enqueue(WORKER, {"n": 1})
    with writer.engine.connect() as conn:
        conn.execute(update(active).where(active.c.id == task_id).values(priority=5))
        # ... a writer's transaction is still open here ...
        with ThreadPoolExecutor(1) as pool:
            read = pool.submit(lambda: [t.priority for t in reader.list()])
            try:
                priorities = read.result(timeout=2)
            except TimeoutError:
                pytest.fail("a read waited for another connection's write transaction")
            finally:
                conn.commit()  # lets a blocked reader go
    assert priorities == [2000]  # the last committed state
