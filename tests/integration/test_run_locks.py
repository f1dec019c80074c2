"""Run locks on MariaDB: a live run holds its task's lock until its process ends; a
redelivered copy hands back only leases no live run holds; stranded leases stop counting
against the pace (``bridge.queue.run_locks``, ``bridge.engine.redelivery``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from services import url_of
from sqlalchemy import Engine, select, text, update

from bridge.canary.guard import read_window
from bridge.canary.weights import bucket, canary_of
from bridge.config import load_settings
from bridge.engine.batch import RUNNING_ELSEWHERE, Batch
from bridge.engine.context import FixedCanary, Runtime
from bridge.engine.redelivery import hand_back_redelivered
from bridge.handlers.phabricator import PhabricatorTestWorker
from bridge.handlers.registry import Registry
from bridge.queue import Lease, Outcome, PhorgeQueue, make_engine
from bridge.queue import statements as sql
from bridge.queue.implementations import CELERY
from bridge.queue.model import Leased, NewTask
from bridge.queue.phorge_queue import STRANDED_AFTER
from bridge.queue.run_locks import RunLocks
from bridge.queue.schema import worker_activetask as active

pytestmark = pytest.mark.mariadb

CLASS = "PhabricatorTestWorker"


@pytest.fixture
def rt(mysql_engine: Engine) -> Iterator[Runtime]:
    url = url_of(mysql_engine)
    settings = load_settings({"BRIDGE_DATABASE_URL": url, "BRIDGE_BROKER_URL": "amqp://unused//"})
    runtime = Runtime(settings, PhorgeQueue(make_engine(url)), Registry([PhabricatorTestWorker()]))
    yield runtime
    runtime.runs.close()
    runtime.queue.engine.dispose()


@pytest.fixture
def elsewhere(rt: Runtime) -> Iterator[RunLocks]:
    """Another process's run locks, on a connection of its own."""
    other = RunLocks(rt.queue.engine)
    yield other
    other.close()


def leased(rt: Runtime, count: int = 1) -> tuple[str, list[Leased]]:
    rt.queue.enqueue_many([NewTask(CLASS, {}) for _ in range(count)])
    return rt.queue.lease_to_send(count, "bridge", 300, [CLASS], 1024)


def lease_of(owner: str, item: Leased) -> Lease:
    return Lease(item.id, owner, item.failure_count)


def test_a_held_lock_is_the_sql_twins_and_is_freed_when_its_holder_dies(
    rt, elsewhere, mysql_engine, mysql_server
):
    owner, [item] = leased(rt)
    assert elsewhere.hold([lease_of(owner, item)]) == [True]
    assert rt.runs.hold([lease_of(owner, item)]) == [False], "a live run holds it"
    with mysql_engine.connect() as conn:
        key = conn.execute(
            select(sql.run_lock_key_of(active.c.id)).where(active.c.id == item.id)
        ).scalar_one()
        holder = conn.execute(sql.lock_holder(key)).scalar_one()
    assert key == elsewhere.key(lease_of(owner, item))
    with mysql_server.connect() as root:
        root.execute(text(f"KILL CONNECTION {holder}"))  # its process died
    assert rt.runs.hold([lease_of(owner, item)], wait=2) == [True]


def test_a_redelivered_copy_hands_back_only_leases_no_live_run_holds(rt, elsewhere):
    owner, items = leased(rt, 3)
    running, dead, finished = items
    elsewhere.hold([lease_of(owner, running)])
    Batch(rt, owner, None).run([finished])  # the first delivery ran it before dying
    redelivery = hand_back_redelivered(rt, owner, items)
    assert redelivery.running == [running.id]
    assert redelivery.handed_back == [dead.id]
    assert redelivery.done == [finished.id]
    with rt.queue.engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(select(active))}
    assert rows[running.id].leaseOwner == owner, "a live run keeps its lease"
    assert rows[dead.id].leaseOwner is None, "due again at once, for a new lease"
    assert finished.id not in rows


def test_a_new_side_run_that_died_falls_back_and_counts_as_the_new_sides_failure(rt):
    """Shared at 50% with phd, the redelivered copy's bridge-side rows go to phd for
    good (failureTime set, no failure counted) and the guard's window counts each as a
    fallback; phd's rows (a rollback sent them there meanwhile) are handed back."""
    owner, items = leased(rt, 20)
    rt.canary = FixedCanary(canary_of({CLASS: {"celery": 50}}, None))
    ours = {item.id for item in items if bucket(CELERY, item.id) < 5000}
    assert 0 < len(ours) < len(items)
    redelivery = hand_back_redelivered(rt, owner, items)
    assert sorted(redelivery.handed_back) == sorted(item.id for item in items)
    assert redelivery.fell_back == sorted(ours)
    assert f"{len(ours)} fallen back to the old side" in redelivery.describe()
    with rt.queue.engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(select(active))}
    for item in items:
        row = rows[item.id]
        assert row.leaseOwner is None and row.failureCount == 0
        assert (row.failureTime is not None) == (item.id in ours), item.id
    window = read_window(rt.queue.engine, CLASS, CELERY, 300, 2000)
    assert (window.new.runs, window.new.fallbacks) == (len(ours), len(ours))


def test_a_message_does_not_run_a_lease_a_live_run_holds(rt, elsewhere):
    owner, [item] = leased(rt)
    elsewhere.hold([lease_of(owner, item)])
    batch = Batch(rt, owner, None)
    batch.run([item])
    [(_, report, _)] = batch.reports
    assert (report.outcome, report.reason) == (Outcome.LEASE_LOST, RUNNING_ELSEWHERE)
    elsewhere.release([lease_of(owner, item)])
    again = Batch(rt, owner, None)
    again.run([item])
    assert again.reports[0][1].outcome is Outcome.SUCCESS
    assert rt.runs.hold([lease_of(owner, item)]) == [True], "released after its outcome"


def test_a_row_leased_again_after_phd_freed_it_does_not_run_beside_its_live_run(
    rt, elsewhere, mysql_engine
):
    """``bin/phd restart`` frees every lease, a running one of the bridge's included: the
    row leased again (by another poll, or phd) must not run while the first run lives."""
    owner, [item] = leased(rt)
    assert elsewhere.hold([lease_of(owner, item)]) == [True]  # the first run, still going
    with mysql_engine.begin() as conn:  # what `phd restart` does to every lease
        conn.execute(update(active).values(leaseOwner=None, leaseExpires=None))
    again, [item_again] = rt.queue.lease_to_send(1, "bridge", 300, [CLASS], 1024)
    assert (item_again.id, again != owner) == (item.id, True)
    batch = Batch(rt, again, None)
    batch.run([item_again])
    [(_, report, _)] = batch.reports
    assert (report.outcome, report.reason) == (Outcome.LEASE_LOST, RUNNING_ELSEWHERE)
    elsewhere.release([lease_of(owner, item)])
    assert rt.runs.hold([lease_of(again, item_again)]) == [True], "free once the run ended"


def test_stranded_leases_do_not_count_as_in_flight(rt, elsewhere, mysql_engine):
    _, items = leased(rt, 3)
    young, old_running, old_stranded = items
    with mysql_engine.begin() as conn:
        now = conn.execute(select(text("UNIX_TIMESTAMP()"))).scalar_one()
        old = f"bridge:1:{now - STRANDED_AFTER - 5}:host:1"
        conn.execute(
            update(active)
            .where(active.c.id.in_([old_running.id, old_stranded.id]))
            .values(leaseOwner=old)
        )
    elsewhere.hold([Lease(old_running.id, old, old_running.failure_count)])
    [in_flight] = rt.queue.in_flight_by_class("bridge", [CLASS]).values()
    assert in_flight.count == 2, f"#{young.id} and the running one; not the stranded one"


def test_a_lease_this_process_runs_is_held_for_its_other_threads(rt):
    """A named lock is re-entrant for its session, which the process's threads share: a
    redelivered copy in another thread must still see the run."""
    owner, [item] = leased(rt)
    assert rt.runs.hold([lease_of(owner, item)]) == [True]
    assert rt.runs.hold([lease_of(owner, item)]) == [False], "a run of this process holds it"
    rt.runs.release([lease_of(owner, item)])
    assert rt.runs.hold([lease_of(owner, item)]) == [True]


def test_batches_of_every_size_leave_the_engines_statement_cache_as_it_was(rt):
    """A lock statement has a column per lease: cached, each batch size a worker met
    stayed in the engine's compiled cache (15,000 leases in batches of 1-100 kept 89 MB,
    and the soak's worker grew by 1.6 KB a task) and pushed the queue's statements out."""
    cache = rt.queue.engine._compiled_cache
    rt.runs.free([Lease(1, "warm-up", 0)])
    before = len(cache)
    for size in range(1, 41):
        batch = [Lease(task_id, f"size-{size}", 0) for task_id in range(size)]
        assert all(rt.runs.hold(batch))
        assert not any(rt.runs.free(batch))
        rt.runs.release(batch)
    assert len(cache) == before
