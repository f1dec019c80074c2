"""The canary's queue side on MariaDB (issue 28): the server's CRC32 agrees with
Python's bucket, the poll's lease takes exactly the bridge's share through Phorge's
indexes, a fallback is one fenced write, and archive rows name who ran them."""

from __future__ import annotations

from typing import Any

import pytest
from canary import new_side
from services import url_of
from sqlalchemy import BigInteger, select, text, update

from bridge.canary.weights import SCALE, bucket, canary_of
from bridge.config import load_settings
from bridge.engine.batch import run_task
from bridge.engine.context import FixedCanary, Runtime
from bridge.engine.sides import archive_owner
from bridge.handlers.api import Handler, TaskContext, TemporaryFailure
from bridge.handlers.capabilities import TransportHandler
from bridge.handlers.registry import Registry
from bridge.queue import Lease, NewTask, Outcome, PhorgeQueue
from bridge.queue import statements as sql
from bridge.queue.dialect import celery_bucket
from bridge.queue.implementations import CELERY, PYTHON, RUNNER
from bridge.queue.model import MAX_NAME, label_of
from bridge.queue.phorge_queue import RangeSizes
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive
from bridge.queue.session import fell_back, success

pytestmark = pytest.mark.mariadb

CLASS = "CanaryWorker"
OTHER = "OtherWorker"


@pytest.fixture
def q(mysql_queue: PhorgeQueue) -> PhorgeQueue:
    return mysql_queue


def test_the_servers_crc32_bucket_is_pythons_for_10000_ids(q: PhorgeQueue):
    """``CRC32(CONCAT('celery:', id)) % 10000`` in SQL, ``zlib.crc32`` in Python (and
    PHP's ``crc32()``, bridge.canary.weights): one bucket per id, byte for byte."""
    digits = " UNION ALL ".join(f"SELECT {d} AS d" for d in range(10))
    crossed = " CROSS JOIN ".join(f"({digits}) AS {name}" for name in "abcd")
    ids = text(f"SELECT a.d + 10 * b.d + 100 * c.d + 1000 * d.d + 1 AS n FROM {crossed}")
    edges = " UNION ALL ".join(f"SELECT {n}" for n in (0, 2**31, 2**32 - 1))
    every = text(f"{ids.text} UNION ALL {edges}").columns(n=BigInteger).subquery()
    with q.engine.connect() as conn:
        rows = conn.execute(select(every.c.n, celery_bucket(every.c.n))).all()
    assert len(rows) == 10_003
    assert {int(n): b for n, b in rows} == {int(n): bucket(CELERY, int(n)) for n, _ in rows}


@pytest.mark.parametrize("path", ["small classes (taskClass)", "large classes (key_owner)"])
def test_the_lease_takes_exactly_the_bridges_share_in_both_phases(q: PhorgeQueue, path: str):
    if path.startswith("large"):
        q.range_sizes = RangeSizes(bound=10)  # every class "large": one hinted statement
    ids = q.enqueue_many([NewTask(CLASS, {})] * 1500)
    others = q.enqueue_many([NewTask(OTHER, {})] * 30)
    failed = ids[::7]  # failed (or fell back) once: never the bridge's while it shares
    expired = ids[1::5]  # a lease someone lost: the expired phase
    with q.engine.begin() as conn:
        conn.execute(update(active).where(active.c.id.in_(failed)).values(failureTime=1))
        conn.execute(
            update(active)
            .where(active.c.id.in_(expired))
            .values(leaseOwner="4242:1:phd-host:1", leaseExpires=1)
        )
    owner, leased = q.lease_to_send(5000, "bridge", 60, [CLASS, OTHER], 8192, shares={CLASS: 3000})
    never_failed = [i for i in ids if i not in failed]
    got = {t.id for t in leased}
    assert got == new_side(CELERY, 30, never_failed) | set(others)
    assert got & set(expired), "the expired phase took its share too"
    with q.engine.connect() as conn:
        held = set(conn.execute(select(active.c.id).where(active.c.leaseOwner == owner)).scalars())
    assert held == got


def test_a_share_keeps_the_forced_index_plan(q: PhorgeQueue):
    """The hinted candidate SELECT still reads Phorge's index, the share as a filter."""
    q.enqueue_many([NewTask(CLASS, {})] * 50)
    where = sql.LeaseFilter([CLASS, OTHER], shares={CLASS: 5000})
    statement = sql.select_unleased(16, where).compile(
        dialect=q.engine.dialect, compile_kwargs={"literal_binds": True}
    )
    with q.engine.connect() as conn:
        explained = conn.exec_driver_sql(f"EXPLAIN {statement}").mappings().all()
    assert [row["key"] for row in explained] == ["key_owner"]


def test_the_fallback_is_one_fenced_write_and_its_lost_commit_is_told(q: PhorgeQueue):
    [task_id] = q.enqueue_many([NewTask(CLASS, {})])
    [task] = q.lease(1, 600)
    lease = task.lease
    with q.engine.connect() as conn:
        created = conn.execute(select(active.c.dateModified)).scalar_one()
    session = q.session
    assert session.apply([fell_back(Lease(task_id, lease.owner, 3))]) == [False]
    assert session.apply([fell_back(lease)]) == [True]
    assert session.apply([fell_back(lease)]) == [False], "the lease went with it"
    assert session.written(fell_back(lease)) is True
    row = q.get(task_id)
    assert (row.lease_owner, row.lease_expires, row.failure_count) == (None, None, 0)
    assert row.failure_time is not None and row.failure_time >= row.server_time - 5
    assert row.date_modified >= created
    assert q.stats().by_class[CLASS] == {"queued": 1}, "due at once"


class Native(Handler):
    task_classes = (CLASS,)
    phorge_defaults = True

    def __init__(self) -> None:
        self.failing: set[int] = set()

    def run(self, task: TaskContext) -> None:
        if task.id in self.failing:
            raise TemporaryFailure("native broke")
        task.queue_task(OTHER, {})  # archived through the follow-up path


class Runner(TransportHandler):
    implementation = RUNNER
    phorge_defaults = True

    def run(self, task: TaskContext) -> None:
        pass


def runtime(q: PhorgeQueue, canary: Any) -> tuple[Runtime, Native]:
    settings = load_settings({"BRIDGE_DATABASE_URL": url_of(q.engine)})
    native = Native()
    registry = Registry([native], runner=Runner(), runner_classes=(CLASS, OTHER))
    return Runtime(settings, q, registry, FixedCanary(canary)), native


def test_archive_rows_are_labelled_with_who_ran_them(q: PhorgeQueue):
    rt, native = runtime(q, canary_of({CLASS: {"python": 50}}, None))
    ids = q.enqueue_many([NewTask(CLASS, {})] * 60)
    natively = new_side(PYTHON, 50, ids)
    native.failing = set(sorted(natively)[:5])
    tasks = {t.id: t for t in q.lease(len(ids), 600)}
    reports = {i: run_task(rt, tasks[i].lease, task_class=CLASS) for i in ids}
    assert {reports[i].outcome for i in native.failing} == {Outcome.FALLBACK}
    # The fallbacks' old-side run, leased again.
    again = {t.id: t for t in q.lease(10, 600, classes=[CLASS])}
    assert set(again) == native.failing
    for task in again.values():
        assert run_task(rt, task.lease, task_class=CLASS).outcome is Outcome.SUCCESS
    with q.engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(archive).where(archive.c.id.in_(ids)))}
    assert sorted(rows) == ids and {r.result for r in rows.values()} == {0}
    labels = {i: label_of(rows[i].leaseOwner) for i in ids}
    expected = {
        # The native runs queued a follow-up each: their labels count it.
        i: "runner-fallback" if i in native.failing else "native~1" if i in natively else "runner"
        for i in ids
    }
    assert labels == expected
    assert max(len(r.leaseOwner) for r in rows.values()) <= MAX_NAME
    assert {r.failureCount for r in rows.values()} == {0}


def test_a_lost_commit_of_a_labelled_archive_is_found_under_its_label(q: PhorgeQueue):
    [task_id] = q.enqueue_many([NewTask(CLASS, {})])
    [task] = q.lease(1, 600)
    labelled = archive_owner(task.lease.owner, "native")
    assert q.session.apply([success(task.lease, 1000, labelled)]) == [True]
    assert q.session.written(success(task.lease, 1000, labelled)) is True
    assert q.session.written(success(task.lease, 1000)) is False, "not under the bare owner"
    with q.engine.connect() as conn:
        owner = conn.execute(select(archive.c.leaseOwner)).scalar_one()
    assert owner == labelled and q.get(task_id).archived
    assert SCALE == 10_000
