"""The queue's defences against single bad rows, redelivered dispatches and racing polls.

Each test here failed before its fix: one non-UTF-8 data row stopped every lease; a
dispatch redelivered after a temporary failure ran again inside its retry wait; two
overlapping polls both filled the same capacity; a follow-up of a priority-0 parent
could never be queued.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import outcomes
import pytest
from bad_rows import corrupt_data
from sqlalchemy import Engine, select, update

from bridge.queue import NewTask, OperatorActions, PhorgeQueue, TaskFilter, make_engine
from bridge.queue.model import PRIORITY_DEFAULT
from bridge.queue.schema import worker_activetask as active
from bridge.queue.session import temporary_failure

pytestmark = pytest.mark.mariadb
WORKER = "PhabricatorTestWorker"


@pytest.fixture
def q(mysql_engine: Engine) -> Iterator[PhorgeQueue]:
    """A queue on the product's own engine settings (pool included)."""
    queue = PhorgeQueue(make_engine(mysql_engine.url.render_as_string(hide_password=False)))
    yield queue
    queue.dispose()


def test_a_non_utf8_data_row_fails_alone_and_never_stops_the_lease(q):
    ids = q.enqueue_many([NewTask(WORKER, {"n": n}) for n in range(5)])
    corrupt_data(q, ids[2])
    tasks = q.lease(5, 300)
    assert sorted(t.id for t in tasks) == ids
    bad = next(t for t in tasks if t.id == ids[2])
    assert "not valid UTF-8" in (bad.data_error or "")
    assert [t.data for t in sorted(tasks, key=lambda t: t.id) if t.id != ids[2]] == [
        {"n": 0},
        {"n": 1},
        {"n": 3},
        {"n": 4},
    ]


def test_an_operator_can_list_and_cancel_a_non_utf8_row(q):
    [task_id] = q.enqueue_many([NewTask(WORKER, {})])
    corrupt_data(q, task_id)
    [listed] = q.list(TaskFilter(ids=[task_id]))
    assert "not valid UTF-8" in (listed.data_error or "")
    [result] = OperatorActions(q).cancel(TaskFilter(ids=[task_id]))
    assert result.done


def test_a_dispatch_redelivered_during_its_retry_wait_no_longer_holds(q):
    q.enqueue(WORKER, {})
    [task] = q.lease(1, 300)
    session = q.session
    assert session.check(task.lease) is not None
    assert session.apply([temporary_failure(task.lease, 600)]) == [True]
    # Same owner, unexpired lease (the retry wait): PHP's fence alone would still pass.
    row = q.get(task.id)
    assert (row.lease_owner, row.failure_count) == (task.lease_owner, 1)
    assert session.check(task.lease) is None
    assert not session.complete(task.lease, 1)
    assert session.apply([temporary_failure(task.lease, 600)]) == [False]
    assert q.get(task.id).failure_count == 1


def test_leasing_by_id_takes_only_those_tasks_in_both_phases(q):
    ids = q.enqueue_many([NewTask(WORKER, {}) for _ in range(4)])
    first = q.lease(4, 1, ids=[ids[1], ids[3]])
    assert sorted(t.id for t in first) == [ids[1], ids[3]]
    with q.engine.begin() as conn:  # expire them: phase 2 must also respect the ids
        conn.execute(update(active).where(active.c.id.in_(ids)).values(leaseExpires=1))
    again = q.lease(4, 300, ids=[ids[3]])
    assert [t.id for t in again] == [ids[3]]
    assert q.lease(4, 300, ids=[]) == []


def test_only_one_poll_holds_the_poll_lock(q):
    with q.poll_lock("bridge") as first:
        assert isinstance(first, int) and first > 1_600_000_000
        with q.poll_lock("bridge") as second:
            assert second is None
        with q.poll_lock("other-prefix") as other:
            assert other is not None
    with q.poll_lock("bridge") as after:
        assert after is not None


def test_a_follow_up_of_a_priority_zero_parent_gets_the_default_priority(q):
    [task_id] = q.enqueue_many([NewTask(WORKER, {})])
    with q.engine.begin() as conn:
        conn.execute(update(active).where(active.c.id == task_id).values(priority=0))
    [task] = q.lease(1, 300)
    assert outcomes.complete(q, task.id, task.lease_owner, 1, [NewTask(WORKER, {"child": 1})])
    with q.engine.connect() as conn:
        priorities = conn.execute(select(active.c.priority)).scalars().all()
    assert priorities == [PRIORITY_DEFAULT]


def test_more_threads_than_the_pool_holds_each_get_a_session(q):
    """A threads pool of 32 (Conduit calls) must not wait on a connection pool of 5 + 10."""
    count = 25
    q.enqueue_many([NewTask(WORKER, {}) for _ in range(count)])
    tasks = q.lease(count, 300)
    started, results = threading.Barrier(count), []

    def complete(task) -> None:
        session = q.session  # each thread's own, held while the thread lives
        started.wait(timeout=60)
        results.append(session.complete(task.lease, 1))

    threads = [threading.Thread(target=complete, args=(t,)) for t in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results == [True] * count
