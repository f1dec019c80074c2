"""PhorgeQueue keeps Phorge's queue semantics, on MariaDB and on SQLite alike.

First Phorge's own ``PhabricatorWorkerTestCase``, test for test; then what the
bridge promises beyond it: stale owners, delays, yields, follow-ups, bin/worker's
actions and refusals, reads, stats, bad input and payloads.

Time passes by rewriting ``leaseExpires`` (and friends) relative to the database
clock, never by sleeping. The queue under test is built by ``make_engine`` on the
fixture's database, so it runs with the bridge's own connection setup.
"""

from __future__ import annotations

from collections.abc import Callable

import outcomes
import pytest
from sqlalchemy import event, func, insert, select, update

from bridge.config import MAX_OWNER_PREFIX
from bridge.queue import Lease, OperatorActions, PhorgeQueue, make_engine
from bridge.queue.dialect import db_now
from bridge.queue.model import (
    MAX_UINT32,
    PRIORITY_DEFAULT,
    RESULT_CANCELLED,
    RESULT_FAILURE,
    RESULT_SUCCESS,
    YIELD_OWNER,
    NewTask,
    State,
    Task,
    TaskFilter,
)
from bridge.queue.schema import lisk_counter, metadata
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive
from bridge.queue.schema import worker_taskdata as taskdata

WORKER = "PhabricatorTestWorker"
BIG_KEY = 7713765376809813936  # a FeedPublisherWorker chronological key, > 2**53


@pytest.fixture
def q(engine) -> PhorgeQueue:
    queue = PhorgeQueue(make_engine(engine.url.render_as_string(hide_password=False)))
    yield queue
    queue.engine.dispose()


# -- helpers: reading rows, letting time pass, leasing one task ----------------------------


def now(q: PhorgeQueue) -> int:
    return q.server_time()


def _row(q: PhorgeQueue, table, task_id: int):
    with q.engine.connect() as conn:
        return conn.execute(select(table).where(table.c.id == task_id)).first()


def active_row(q: PhorgeQueue, task_id: int):
    return _row(q, active, task_id)


def archive_row(q: PhorgeQueue, task_id: int):
    return _row(q, archive, task_id)


def data_text(q: PhorgeQueue, task_id: int) -> str:
    """The JSON text stored in the task's ``worker_taskdata`` row."""
    row = active_row(q, task_id) or archive_row(q, task_id)
    with q.engine.connect() as conn:
        return conn.execute(select(taskdata.c.data).where(taskdata.c.id == row.dataID)).scalar()


def counter(q: PhorgeQueue) -> int | None:
    with q.engine.connect() as conn:
        return conn.execute(select(lisk_counter.c.counterValue)).scalar()


def update_active(q: PhorgeQueue, task_id: int, **values) -> None:
    with q.engine.begin() as conn:
        changed = conn.execute(update(active).where(active.c.id == task_id).values(**values))
        assert changed.rowcount == 1


def expire(q: PhorgeQueue, task_id: int, seconds_ago: int = 1) -> None:
    """Let time pass: the task's lease (or retry wait, or yield) ended ``seconds_ago`` ago."""
    update_active(q, task_id, leaseExpires=db_now() - seconds_ago)


def snapshot(q: PhorgeQueue) -> dict[str, list[tuple]]:
    """Every row of the four tables, to show that a call wrote nothing."""
    with q.engine.connect() as conn:
        return {
            table.name: [
                tuple(row)
                for row in conn.execute(select(table).order_by(*table.primary_key.columns))
            ]
            for table in metadata.sorted_tables
        }


def assert_now(q: PhorgeQueue, epoch: int | None, slack: int = 2) -> None:
    """``epoch`` was taken from the database clock within the last ``slack`` seconds."""
    current = now(q)
    assert epoch is not None and current - slack <= epoch <= current


def expect_next_lease(q: PhorgeQueue, task_id: int | None) -> Task | None:
    """Phorge's ``expectNextLease``: lease one task and check which (None: nothing)."""
    leased = q.lease(1, owner_prefix="test")
    if task_id is None:
        assert leased == []
        return None
    assert [task.id for task in leased] == [task_id]
    return leased[0]


def leased_task(q: PhorgeQueue, data=None, task_class: str = WORKER, **options) -> Task:
    """A new task, leased at once (so no other task may be due when this is called)."""
    return expect_next_lease(q, q.enqueue(task_class, data, **options))


def make_task(q: PhorgeQueue, state: str, task_class: str = WORKER, **options) -> int:
    """A task in ``state``, brought there through the API as workers and operators do.

    States that lease come first in a test: a queued task would be leased instead.
    """
    data = {"state": state}
    if state == "queued":
        return q.enqueue(task_class, data, **options)
    if state == "delayed":
        return q.enqueue(task_class, data, delay_until=now(q) + 3600, **options)
    task = leased_task(q, data, task_class, **options)
    owner = task.lease_owner
    if state == "failed":  # one temporary failure first, then a permanent one
        assert outcomes.fail_temporary(q, task.id, owner, 0)
        expire(q, task.id, 100000)  # the oldest expiry: leased next even if others expired
        owner = expect_next_lease(q, task.id).lease_owner
    outcome = {
        "leased": lambda: True,
        "expired": lambda: expire(q, task.id) or True,
        "waiting": lambda: outcomes.fail_temporary(q, task.id, owner, 600),
        "yielded": lambda: outcomes.yield_(q, task.id, owner, 600),
        "succeeded": lambda: outcomes.complete(q, task.id, owner, 1000),
        "failed": lambda: outcomes.fail_permanent(q, task.id, owner),
        "cancelled": lambda: OperatorActions(q).cancel(TaskFilter(ids=[task.id]))[0].done,
    }[state]
    assert outcome()
    return task.id


# -- Phorge's PhabricatorWorkerTestCase, reproduced ----------------------------------------


def test_lease_works(q):
    task_id = q.enqueue(WORKER, {"doWork": "nothing"})
    [task] = q.lease(1, owner_prefix="test")
    owner = task.lease_owner
    assert owner.startswith("test:")
    assert (task.id, task.task_class, task.data) == (task_id, WORKER, {"doWork": "nothing"})
    assert (task.lease_owner, task.failure_count, task.priority) == (owner, 0, PRIORITY_DEFAULT)
    # Phorge's default lease, counted on the database clock.
    assert 7200 - 2 <= task.lease_expires - task.server_time <= 7200
    assert active_row(q, task_id).leaseOwner == owner
    assert task.state is State.LEASED


def test_a_task_cannot_be_leased_twice(q):
    task_id = q.enqueue(WORKER)
    expect_next_lease(q, task_id)
    expect_next_lease(q, None)


def test_older_tasks_lease_first_at_equal_priority(q):
    first, second = q.enqueue(WORKER), q.enqueue(WORKER)
    expect_next_lease(q, first)
    expect_next_lease(q, second)


def test_never_leased_tasks_lease_before_expired_ones(q):
    first, second = q.enqueue(WORKER), q.enqueue(WORKER)
    update_active(q, first, leaseOwner="test", leaseExpires=db_now() - 100000)
    expect_next_lease(q, second)
    expect_next_lease(q, first)


def test_expired_tasks_lease_oldest_expiry_first(q):
    first, second = q.enqueue(WORKER), q.enqueue(WORKER)
    update_active(q, first, leaseOwner="test", leaseExpires=db_now() - 100000)
    update_active(q, second, leaseOwner="test", leaseExpires=db_now() - 200000)
    expect_next_lease(q, second)
    expect_next_lease(q, first)


def test_lower_priority_number_first_and_fifo_within_a_priority(q):
    first = q.enqueue(WORKER, priority=2)
    second = q.enqueue(WORKER, priority=2)
    urgent = q.enqueue(WORKER, priority=1)
    expect_next_lease(q, urgent)
    expect_next_lease(q, first)
    expect_next_lease(q, second)


@pytest.mark.parametrize("wait", [None, 60, 0])
def test_temporary_failure_keeps_the_row_and_counts_it(q, wait):
    task = leased_task(q, {"n": 1})
    if wait is None:
        assert outcomes.fail_temporary(q, task.id, task.lease_owner)
    else:
        assert outcomes.fail_temporary(q, task.id, task.lease_owner, wait)
    row = active_row(q, task.id)
    assert (row.failureCount, row.leaseOwner) == (1, task.lease_owner)
    assert_now(q, row.failureTime)
    # The wait is counted from the failure, on the database clock (300 s by default).
    assert row.leaseExpires == row.failureTime + (300 if wait is None else wait)
    assert archive_row(q, task.id) is None


def test_past_the_maximum_retry_count_the_next_run_fails_permanently(q):
    maximum = 3  # getMaximumRetryCount; the runtime fails a run once failureCount > maximum
    task_id = q.enqueue(WORKER, {"doWork": "fail-temporary"})
    for failures in range(1, maximum + 2):
        task = expect_next_lease(q, task_id)
        assert outcomes.fail_temporary(q, task_id, task.lease_owner, 0)
        assert active_row(q, task_id).failureCount == failures
        expire(q, task_id)  # Phorge's test waits -60 s before each retry
    task = expect_next_lease(q, task_id)
    assert task.failure_count == maximum + 1
    # Exceeded the maximum number of failures:
    assert outcomes.fail_permanent(q, task_id, task.lease_owner)
    row = archive_row(q, task_id)
    assert (row.result, row.duration, row.failureCount) == (RESULT_FAILURE, 0, maximum + 1)
    assert active_row(q, task_id) is None
    expect_next_lease(q, None)


def test_a_wait_before_retry_holds_the_task_back(q):
    task = leased_task(q)
    assert outcomes.fail_temporary(q, task.id, task.lease_owner, 1000000)
    expect_next_lease(q, None)
    assert q.get(task.id).state is State.RETRY_WAIT
    expire(q, task.id)  # the wait is over
    assert expect_next_lease(q, task.id).failure_count == 1


def test_permanent_failure_archives_result_1(q):
    task = leased_task(q, {"doWork": "fail-permanent"})
    assert outcomes.fail_permanent(q, task.id, task.lease_owner)
    row = archive_row(q, task.id)
    assert (row.result, row.duration) == (RESULT_FAILURE, 0)
    assert active_row(q, task.id) is None
    assert q.get(task.id).data == {"doWork": "fail-permanent"}  # the data row outlives it


def test_success_archives_result_0_keeping_the_active_rows_columns(q):
    phids = {"object_phid": "PHID-TASK-abcd", "container_phid": "PHID-REPO-efgh"}
    task = leased_task(q, {"doWork": "succeed"}, priority=1500, **phids)
    assert outcomes.fail_temporary(q, task.id, task.lease_owner, 0)  # so failureTime is set
    update_active(q, task.id, dateCreated=db_now() - 5000, leaseExpires=db_now() - 1)
    task = expect_next_lease(q, task.id)
    before = active_row(q, task.id)

    assert outcomes.complete(q, task.id, task.lease_owner, 1_234_567)

    row = archive_row(q, task.id)
    assert (row.result, row.duration) == (RESULT_SUCCESS, 1_234_567)  # microseconds
    assert_now(q, row.archivedEpoch)
    assert_now(q, row.dateModified)
    kept = ("id", "taskClass", "leaseOwner", "leaseExpires", "failureCount", "dataID")
    kept += ("priority", "objectPHID", "containerPHID", "dateCreated")
    assert {c: getattr(row, c) for c in kept} == {c: getattr(before, c) for c in kept}
    assert row.failureCount == 1 and row.leaseOwner == task.lease_owner
    assert "failureTime" not in row._fields
    assert q.get(task.id).failure_time is None
    assert active_row(q, task.id) is None
    assert data_text(q, task.id) == '{"doWork":"succeed"}'


def test_a_run_longer_than_71_minutes_is_archived_with_its_duration(q):
    # duration is a bigint unsigned of microseconds: 2**32 µs is only 71.6 minutes.
    task = leased_task(q)
    three_hours = 3 * 3600 * 1_000_000
    assert outcomes.complete(q, task.id, task.lease_owner, three_hours)
    assert archive_row(q, task.id).duration == three_hours


def test_renew_gives_the_required_lease_time(q):
    task = leased_task(q)
    assert outcomes.renew(q, task.id, task.lease_owner, 1000000)
    assert active_row(q, task.id).leaseExpires - now(q) > 1000000 - 3


# -- fencing: only the current owner's outcome counts --------------------------------------

OUTCOMES: dict[str, Callable[[PhorgeQueue, int, str], bool]] = {
    "complete": lambda q, task_id, owner: outcomes.complete(q, task_id, owner, 1000),
    "complete+followups": lambda q, task_id, owner: outcomes.complete(
        q, task_id, owner, 1000, [NewTask("PhabricatorSearchWorker", {"x": 1})]
    ),
    "fail_temporary": lambda q, task_id, owner: outcomes.fail_temporary(q, task_id, owner, 60),
    "fail_permanent": lambda q, task_id, owner: outcomes.fail_permanent(q, task_id, owner),
    "yield_": lambda q, task_id, owner: outcomes.yield_(q, task_id, owner, 60),
    "renew": lambda q, task_id, owner: outcomes.renew(q, task_id, owner, 3600),
}


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_the_live_owner_wins_each_outcome(q, outcome):
    task = leased_task(q)
    before = snapshot(q)
    assert OUTCOMES[outcome](q, task.id, task.lease_owner) is True
    assert snapshot(q) != before


@pytest.mark.parametrize("released", [True, False], ids=["re-leased", "expired"])
@pytest.mark.parametrize("outcome", OUTCOMES)
def test_a_stale_owner_changes_nothing(q, outcome, released):
    stale = leased_task(q, {"n": 1})
    expire(q, stale.id)
    if released:
        assert expect_next_lease(q, stale.id).lease_owner != stale.lease_owner
    before = snapshot(q)
    assert OUTCOMES[outcome](q, stale.id, stale.lease_owner) is False
    assert snapshot(q) == before


def test_held_and_free_own_touch_only_the_callers_live_leases(q):
    mine, theirs = leased_task(q), leased_task(q)
    assert q.session.check(mine.lease).id == mine.id
    assert q.session.check(Lease(theirs.id, mine.lease_owner, theirs.failure_count)) is None
    assert q.free_own([mine.id, theirs.id], mine.lease_owner) == 1
    assert active_row(q, theirs.id).leaseOwner == theirs.lease_owner
    assert q.session.check(mine.lease) is None
    expect_next_lease(q, mine.id)  # handed back, due at once


# -- lease options -------------------------------------------------------------------------


def test_lease_honours_classes_exclusions_limit_and_lease_seconds(q):
    search = q.enqueue("PhabricatorSearchWorker")
    mail = q.enqueue("PhabricatorMetaMTAWorker", 2)
    feed = q.enqueue("FeedPublisherWorker")
    assert q.lease(5, owner_prefix="test", classes=[]) == []
    assert q.lease(0, owner_prefix="test") == []
    [task] = q.lease(5, 30, owner_prefix="test", classes=["PhabricatorMetaMTAWorker"])
    assert (task.id, task.data) == (mail, 2)
    assert 28 <= task.lease_expires - task.server_time <= 30
    leased = q.lease(5, owner_prefix="test", exclude_classes=["FeedPublisherWorker"])
    assert [t.id for t in leased] == [search]
    assert [t.id for t in q.lease(5, owner_prefix="test")] == [feed]


def test_lease_returns_only_the_rows_this_call_won(q):
    ids = [q.enqueue(WORKER, {"n": n}) for n in range(3)]
    first = q.lease(2, owner_prefix="test")
    second = q.lease(5, owner_prefix="test")
    assert [t.id for t in first] == ids[:2]
    assert [t.id for t in second] == ids[2:]
    assert [t.data for t in first + second] == [{"n": 0}, {"n": 1}, {"n": 2}]


# -- delays, yields, awaken ----------------------------------------------------------------


def test_a_delayed_task_is_not_leased_before_its_time(q):
    task_id = q.enqueue(WORKER, delay_until=now(q) + 3600)
    assert q.get(task_id).state is State.DELAYED
    expect_next_lease(q, None)
    update_active(q, task_id, leaseExpires=db_now())  # its time has come
    expect_next_lease(q, task_id)


def test_a_delay_already_due_leases_at_once(q):
    task_id = q.enqueue(WORKER, delay_until=now(q) - 10)
    expect_next_lease(q, task_id)


@pytest.mark.parametrize("asked, held_back", [(0, 5), (1, 5), (60, 60)])
def test_a_yielded_task_comes_back_after_its_yield(q, asked, held_back):
    task = leased_task(q, {"n": 1})
    assert outcomes.yield_(q, task.id, task.lease_owner, asked)
    row = active_row(q, task.id)
    assert (row.leaseOwner, row.failureCount) == (YIELD_OWNER, 0)
    assert row.leaseExpires - row.dateModified == held_back  # at least 5 s
    assert q.get(task.id).state is State.YIELDED
    expect_next_lease(q, None)
    expire(q, task.id)  # the yield is over: leased again (phase 2: it has an owner)
    again = expect_next_lease(q, task.id)
    assert (again.failure_count, again.data) == (0, {"n": 1})


def test_awaken_brings_a_yielded_task_forward(q):
    task_id = make_task(q, "yielded")
    expect_next_lease(q, None)
    assert OperatorActions(q).awaken([task_id]) == 1
    row = active_row(q, task_id)
    assert row.leaseOwner == YIELD_OWNER
    assert_now(q, row.leaseExpires + 3600)
    expect_next_lease(q, task_id)


def test_awaken_refuses_failed_and_unyielded_tasks(q):
    failed = leased_task(q)
    assert outcomes.fail_temporary(q, failed.id, failed.lease_owner, 0)
    expire(q, failed.id)
    retried = expect_next_lease(q, failed.id)
    assert outcomes.yield_(q, failed.id, retried.lease_owner, 3600)  # yielded, but failureCount 1
    others = [make_task(q, state) for state in ("leased", "waiting", "queued", "delayed")]
    before = snapshot(q)
    assert OperatorActions(q).awaken([failed.id, *others]) == 0
    assert OperatorActions(q).awaken([]) == 0
    assert snapshot(q) == before


# -- follow-ups ----------------------------------------------------------------------------


def test_followups_are_enqueued_with_the_archive(q):
    parent = leased_task(q, {"parent": True}, priority=1000)
    followups = [
        NewTask("PhabricatorSearchWorker", {"documentPHID": "PHID-TASK-1"}),
        NewTask(
            "FeedPublisherWorker",
            {"key": BIG_KEY},
            priority=3500,
            object_phid="PHID-TASK-1",
            container_phid="PHID-REPO-1",
        ),
        NewTask("PhabricatorMetaMTAWorker", 2, delay_until=now(q) + 600),
    ]
    assert outcomes.complete(q, parent.id, parent.lease_owner, 1500, followups)

    assert archive_row(q, parent.id).result == RESULT_SUCCESS
    search, feed, mail = sorted(q.list(TaskFilter(active=True)), key=lambda t: t.id)
    # Ids come from lisk_counter, right after the parent's.
    assert [search.id, feed.id, mail.id] == [parent.id + 1, parent.id + 2, parent.id + 3]
    assert counter(q) == parent.id + 3
    assert (search.task_class, search.data, search.priority) == (
        "PhabricatorSearchWorker",
        {"documentPHID": "PHID-TASK-1"},
        1000,  # the parent's priority, as flushTaskQueue($defaults)
    )
    assert (feed.data, feed.priority, feed.object_phid, feed.container_phid) == (
        {"key": BIG_KEY},
        3500,
        "PHID-TASK-1",
        "PHID-REPO-1",
    )
    assert (mail.data, mail.priority, mail.state) == (2, 1000, State.DELAYED)
    assert [t.state for t in (search, feed)] == [State.QUEUED, State.QUEUED]


def test_followups_and_the_archive_commit_together(q):
    parent = leased_task(q, priority=1000)
    before = snapshot(q)

    def crash_on_followup_insert(conn, cursor, statement, *args):
        if statement.startswith("INSERT INTO worker_activetask"):
            raise RuntimeError("crashed while enqueuing the follow-ups")

    event.listen(q.engine, "before_cursor_execute", crash_on_followup_insert)
    try:
        with pytest.raises(RuntimeError):
            outcomes.complete(
                q, parent.id, parent.lease_owner, 1, [NewTask("PhabricatorSearchWorker", {})]
            )
    finally:
        event.remove(q.engine, "before_cursor_execute", crash_on_followup_insert)
    assert snapshot(q) == before  # still leased, no archive row, no data row, no id taken
    assert outcomes.complete(
        q, parent.id, parent.lease_owner, 1, [NewTask("PhabricatorSearchWorker", {})]
    )


@pytest.mark.parametrize(
    "followup",
    [
        NewTask("", {}),
        NewTask("X" * 65, {}),
        NewTask(WORKER, {1, 2}),
        NewTask(WORKER, {}, priority=-1),
        NewTask(WORKER, {}, priority=0),
        NewTask(WORKER, {}, priority="5"),
    ],
    ids=["empty-class", "long-class", "set-data", "priority-1", "priority0", "priority-str"],
)
def test_a_bad_followup_is_refused_before_the_task_is_archived(q, followup):
    task = leased_task(q)
    before = snapshot(q)
    with pytest.raises(ValueError):
        outcomes.complete(q, task.id, task.lease_owner, 1, [followup])
    assert snapshot(q) == before


# -- bin/worker's operator actions ---------------------------------------------------------

ACTIONS: dict[str, Callable[[PhorgeQueue, TaskFilter], list]] = {
    "cancel": lambda q, selector: OperatorActions(q).cancel(selector),
    "free": lambda q, selector: OperatorActions(q).free(selector),
    "delay": lambda q, selector: OperatorActions(q).delay(selector, now(q) + 3600),
    "priority": lambda q, selector: OperatorActions(q).set_priority(selector, PRIORITY_DEFAULT),
    "retry": lambda q, selector: OperatorActions(q).retry(selector),
}


@pytest.mark.parametrize(
    "action, state, reason",
    [
        ("cancel", "succeeded", "ARCHIVED"),
        ("cancel", "cancelled", "ARCHIVED"),
        ("free", "failed", "ARCHIVED"),
        ("free", "queued", "FREE"),
        ("free", "delayed", "FREE"),
        ("delay", "succeeded", "ARCHIVED"),
        ("delay", "leased", "LEASED"),
        ("delay", "expired", "LEASED"),
        ("delay", "waiting", "LEASED"),
        ("delay", "yielded", "LEASED"),
        ("priority", "failed", "ARCHIVED"),
        ("priority", "queued", "UNCHANGED"),  # it already has PRIORITY_DEFAULT
        ("retry", "queued", "ACTIVE"),
        ("retry", "leased", "ACTIVE"),
        ("retry", "succeeded", "SUCCEEDED"),  # only with repeat
    ],
)
def test_operator_actions_refuse_as_bin_worker_does(q, action, state, reason):
    task_id = make_task(q, state)
    before = snapshot(q)
    [result] = ACTIONS[action](q, TaskFilter(ids=[task_id]))
    assert (result.id, result.done) == (task_id, False)
    assert result.reason.startswith(f"{reason}:")
    assert result.label == f"{WORKER}#{task_id}"
    assert snapshot(q) == before


def test_operator_actions_refuse_an_unconstrained_selector(q):
    # bin/worker: 'Use constraint flags (like "--id" or "--class") to select which tasks
    # to affect.' An empty selector must not act on the whole queue.
    for state in ("failed", "leased", "queued"):
        make_task(q, state)
    before = snapshot(q)
    for name, act in ACTIONS.items():
        with pytest.raises(ValueError):
            act(q, TaskFilter())
        assert snapshot(q) == before, f"{name} with no selector changed the queue"


@pytest.mark.parametrize("state", ["leased", "expired", "waiting", "yielded", "queued", "delayed"])
def test_cancel_archives_result_2_and_breaks_the_lease(q, state):
    task_id = make_task(q, state)
    held = active_row(q, task_id)
    [result] = OperatorActions(q).cancel(TaskFilter(ids=[task_id]))
    assert result.done
    row = archive_row(q, task_id)
    assert (row.result, row.duration, row.leaseOwner) == (RESULT_CANCELLED, 0, None)
    assert_now(q, row.leaseExpires)
    assert (row.failureCount, row.dataID, row.dateCreated) == (
        held.failureCount,
        held.dataID,
        held.dateCreated,
    )
    assert active_row(q, task_id) is None
    assert q.get(task_id).data == {"state": state}
    if held.leaseOwner:  # the worker that held it can no longer report anything
        assert not outcomes.complete(q, task_id, held.leaseOwner, 1)


@pytest.mark.parametrize("state", ["leased", "expired", "waiting", "yielded"])
def test_free_breaks_a_lease_and_the_task_is_due_at_once(q, state):
    task_id = make_task(q, state)
    failures = active_row(q, task_id).failureCount
    [result] = OperatorActions(q).free(TaskFilter(ids=[task_id]))
    assert result.done
    row = active_row(q, task_id)
    assert row.leaseOwner is None and row.failureCount == failures
    assert_now(q, row.leaseExpires)
    assert q.get(task_id).state is State.QUEUED
    expect_next_lease(q, task_id)


@pytest.mark.parametrize("state", ["queued", "delayed"])
def test_delay_holds_an_unleased_task_until_the_given_time(q, state):
    task_id = make_task(q, state)
    until = now(q) + 7 * 86400
    [result] = OperatorActions(q).delay(TaskFilter(ids=[task_id]), until)
    assert result.done
    assert active_row(q, task_id).leaseExpires == until
    assert q.get(task_id).state is State.DELAYED
    expect_next_lease(q, None)
    with pytest.raises(ValueError):
        OperatorActions(q).delay(TaskFilter(ids=[task_id]), -1)


def test_priority_reorders_active_tasks(q):
    leased = make_task(q, "leased")
    first, second = q.enqueue(WORKER), q.enqueue(WORKER)
    results = OperatorActions(q).set_priority(TaskFilter(ids=[second, leased]), 1000)
    assert sorted((r.id, r.done) for r in results) == [(leased, True), (second, True)]
    assert active_row(q, leased).priority == 1000
    expect_next_lease(q, second)
    expect_next_lease(q, first)


@pytest.mark.parametrize("priority", [0, -1, "5", True, 2.5, MAX_UINT32 + 1])
def test_priority_must_be_a_positive_integer(q, priority):
    task_id = q.enqueue(WORKER)
    before = snapshot(q)
    with pytest.raises(ValueError):
        OperatorActions(q).set_priority(TaskFilter(ids=[task_id]), priority)
    assert snapshot(q) == before


@pytest.mark.parametrize(
    "state, repeat", [("failed", False), ("cancelled", False), ("succeeded", True)]
)
def test_retry_requeues_an_archived_task_under_its_own_id(q, state, repeat):
    task_id = make_task(
        q, state, priority=1500, object_phid="PHID-TASK-a", container_phid="PHID-REPO-b"
    )
    archived = archive_row(q, task_id)
    ids_taken = counter(q)

    [result] = OperatorActions(q).retry(TaskFilter(ids=[task_id]), repeat=repeat)

    assert result.done
    row = active_row(q, task_id)
    kept = ("id", "taskClass", "dataID", "priority", "objectPHID", "containerPHID", "dateCreated")
    assert {c: getattr(row, c) for c in kept} == {c: getattr(archived, c) for c in kept}
    assert (row.leaseOwner, row.leaseExpires, row.failureCount, row.failureTime) == (
        None,
        0,
        0,
        None,
    )
    assert archive_row(q, task_id) is None
    assert counter(q) == ids_taken
    assert expect_next_lease(q, task_id).data == {"state": state}  # the data row was kept


# -- reads: get, list and bin/worker's selectors -------------------------------------------


@pytest.fixture
def catalog(q) -> dict[str, int]:
    """Five tasks, two archived: name -> id (ids 1..5 in this order)."""
    tasks = {"a3": make_task(q, "succeeded", "ClassA", priority=500)}
    tasks["a1"] = q.enqueue(
        "ClassA", priority=1000, object_phid="PHID-OBJ-1", container_phid="PHID-REPO-1"
    )
    tasks["a2"] = q.enqueue(
        "ClassA", priority=2000, object_phid="PHID-OBJ-2", container_phid="PHID-REPO-1"
    )
    tasks["b1"] = q.enqueue(
        "ClassB", priority=3000, object_phid="PHID-OBJ-1", container_phid="PHID-REPO-2"
    )
    tasks["b2"] = q.enqueue("ClassB", {"b": 2}, priority=4000)
    assert OperatorActions(q).cancel(TaskFilter(ids=[tasks["b2"]]))[0].done
    update_active(q, tasks["a2"], failureCount=2)
    update_active(q, tasks["b1"], failureCount=5)
    return tasks


@pytest.mark.parametrize(
    "selector, expected",
    [
        ({}, ["b1", "a2", "a1", "b2", "a3"]),  # active first, newest first
        ({"ids": ["a1", "b2"]}, ["a1", "b2"]),
        ({"classes": ["ClassB"]}, ["b1", "b2"]),
        ({"active": True}, ["b1", "a2", "a1"]),
        ({"archived": True}, ["b2", "a3"]),
        ({"container_phids": ["PHID-REPO-1"]}, ["a2", "a1"]),
        ({"object_phids": ["PHID-OBJ-1"]}, ["b1", "a1"]),
        ({"object_phids": ["PHID-OBJ-1", "PHID-OBJ-2"], "archived": True}, []),
        ({"min_failure_count": 1}, ["b1", "a2"]),
        ({"max_failure_count": 0}, ["a1", "b2", "a3"]),
        ({"min_failure_count": 2, "max_failure_count": 2}, ["a2"]),
        ({"min_priority": 2000, "max_priority": 3000}, ["b1", "a2"]),
        ({"max_priority": 1000}, ["a1", "a3"]),
        ({"classes": ["ClassA"], "active": True}, ["a2", "a1"]),
        ({"limit": 2}, ["b1", "a2"]),
        ({"limit": 1, "archived": True}, ["b2"]),
        ({"ids": [999]}, []),
    ],
)
def test_list_selects_as_bin_worker(q, catalog, selector, expected):
    if "ids" in selector:
        selector = {**selector, "ids": [catalog.get(name, name) for name in selector["ids"]]}
    tasks = q.list(TaskFilter(**selector))
    assert [t.id for t in tasks] == [catalog[name] for name in expected]
    assert all(t.archived == (t.id in (catalog["a3"], catalog["b2"])) for t in tasks)


def test_get_reads_active_and_archived_tasks(q, catalog):
    a1 = q.get(catalog["a1"])
    assert (a1.task_class, a1.priority, a1.object_phid, a1.container_phid) == (
        "ClassA",
        1000,
        "PHID-OBJ-1",
        "PHID-REPO-1",
    )
    assert (a1.archived, a1.state, a1.result) == (False, State.QUEUED, None)
    b2 = q.get(catalog["b2"])
    assert (b2.archived, b2.state, b2.result, b2.data) == (
        True,
        State.ARCHIVED,
        RESULT_CANCELLED,
        {"b": 2},
    )
    assert q.get(999) is None


# -- stats ---------------------------------------------------------------------------------


def test_stats_count_each_class_and_state(q):
    for state in ("leased", "expired", "waiting", "yielded", "succeeded", "failed", "cancelled"):
        make_task(q, state, "ClassB" if state != "leased" else "ClassA")
    retried = make_task(q, "waiting", "ClassA")
    # Its 600 s wait ran out 100 s ago and it was leased again: leased, not waiting.
    update_active(
        q,
        retried,
        failureTime=db_now() - 700,
        dateModified=db_now() - 700,
        leaseExpires=db_now() - 100,
    )
    expect_next_lease(q, retried)
    make_task(q, "delayed", "ClassA")
    oldest = make_task(q, "queued", "ClassA")
    make_task(q, "queued", "ClassA")
    update_active(q, oldest, dateCreated=db_now() - 500)

    stats = q.stats()

    assert stats.by_class == {
        "ClassA": {"leased": 2, "delayed": 1, "queued": 2},
        "ClassB": {
            "lease-expired": 1,
            "waiting-to-retry": 1,
            "yielded": 1,
            "archived-succeeded": 1,
            "archived-failed": 1,
            "archived-cancelled": 1,
        },
    }
    assert_now(q, stats.server_time)
    assert 500 <= stats.oldest_queued_age <= 502
    assert (stats.total("queued"), stats.total("leased")) == (2, 2)


def test_stats_count_archived_tasks_of_the_window_only(q):
    old = make_task(q, "succeeded")
    make_task(q, "succeeded")
    with q.engine.begin() as conn:
        conn.execute(
            update(archive).where(archive.c.id == old).values(dateModified=db_now() - 7200)
        )
    assert q.stats(archived_window=3600).by_class == {WORKER: {"archived-succeeded": 1}}
    assert q.stats(archived_window=86400).by_class == {WORKER: {"archived-succeeded": 2}}
    assert q.stats().oldest_queued_age is None


# -- enqueue: ids from lisk_counter, the row PHP writes ------------------------------------


def test_enqueue_writes_the_row_php_writes(q):
    task_id = q.enqueue(WORKER, {"a": 1}, object_phid="PHID-TASK-x", container_phid="PHID-REPO-y")
    row = active_row(q, task_id)
    assert row.taskClass == WORKER
    assert (row.leaseOwner, row.leaseExpires, row.failureCount, row.failureTime) == (
        None,
        None,
        0,
        None,
    )
    assert (row.priority, row.objectPHID, row.containerPHID) == (
        PRIORITY_DEFAULT,
        "PHID-TASK-x",
        "PHID-REPO-y",
    )
    assert row.dateCreated == row.dateModified
    assert_now(q, row.dateCreated)
    assert data_text(q, task_id) == '{"a":1}'


def test_task_ids_continue_phps_lisk_counter(q):
    with q.engine.begin() as conn:
        conn.execute(insert(lisk_counter).values(counterName="worker_activetask", counterValue=41))
    assert q.enqueue(WORKER) == 42
    batch = [NewTask(WORKER, {"n": n}) for n in range(3)]
    assert q.enqueue_many(batch) == [43, 44, 45]
    assert counter(q) == 45
    assert q.enqueue_many([]) == []
    assert counter(q) == 45


# -- bad input: a ValueError before anything is written ------------------------------------

BAD_TASKS = {
    "empty class": {"task_class": ""},
    "class of 65 characters": {"task_class": "C" * 65},
    "class not a string": {"task_class": None},
    "priority 0": {"priority": 0},
    "priority -1": {"priority": -1},
    "priority '5'": {"priority": "5"},
    "priority True": {"priority": True},
    "priority 2**32": {"priority": 2**32},
    "data a set": {"data": {1, 2}},
    "data NaN": {"data": {"x": float("nan")}},
    "data infinity": {"data": [float("inf")]},
    "data an object": {"data": object()},
    "negative delay": {"delay_until": -5},
}


@pytest.mark.parametrize("bad", BAD_TASKS.values(), ids=BAD_TASKS.keys())
def test_bad_task_is_refused_before_anything_is_written(q, bad):
    q.enqueue(WORKER, {"existing": True})
    before = snapshot(q)
    task = NewTask(**{"task_class": WORKER, "data": {"ok": 1}, **bad})
    with pytest.raises(ValueError):
        q.enqueue_many([NewTask(WORKER, {"good": 1}), task])  # not even the good one
    with pytest.raises(ValueError):
        q.enqueue(task.task_class, task.data, priority=task.priority, delay_until=task.delay_until)
    assert snapshot(q) == before


def test_boundary_values_are_accepted(q):
    task_id = q.enqueue("C" * 64, [], priority=MAX_UINT32, object_phid="P" * 64)
    row = active_row(q, task_id)
    assert (row.taskClass, row.priority, row.objectPHID) == ("C" * 64, MAX_UINT32, "P" * 64)
    assert q.enqueue(WORKER, priority=1) == task_id + 1


def test_a_phid_over_64_bytes_is_refused_before_anything_is_written(q):
    # objectPHID/containerPHID are varbinary(64): 64 *bytes* once UTF-8 encoded.
    before = snapshot(q)
    with pytest.raises(ValueError):
        q.enqueue(WORKER, object_phid="PHID-" + "é" * 40)  # 45 characters, 85 bytes
    assert snapshot(q) == before


@pytest.mark.parametrize("prefix", ["o" * 65, "o" * 64], ids=["65-characters", "64-characters"])
def test_a_bad_owner_is_refused_before_anything_is_written(q, prefix):
    # The lease mints its owner "prefix:pid:time:host:sequence" into a varchar(64): a
    # prefix that leaves no room for the rest would make a bad owner.
    q.enqueue(WORKER)
    before = snapshot(q)
    with pytest.raises(ValueError):
        q.lease(1, owner_prefix=prefix)
    assert snapshot(q) == before
    # The longest prefix the settings accept is fine: the host name is cut to fit.
    [task] = q.lease(1, owner_prefix="o" * MAX_OWNER_PREFIX)
    assert task.lease_owner.startswith("o" * MAX_OWNER_PREFIX + ":")
    assert len(task.lease_owner) <= 64


@pytest.mark.parametrize(
    "call",
    [
        lambda q, t: outcomes.renew(q, t.id, t.lease_owner, 0),
        lambda q, t: outcomes.complete(q, t.id, t.lease_owner, -1),
        lambda q, t: q.lease(1, 0, owner_prefix="test"),
    ],
    ids=["zero-renew", "negative-duration", "zero-lease"],
)
def test_bad_durations_are_refused_before_anything_is_written(q, call):
    task = leased_task(q)
    q.enqueue(WORKER)
    before = snapshot(q)
    with pytest.raises(ValueError):
        call(q, task)
    assert snapshot(q) == before


def test_negative_waits_and_yields_are_applied_as_phorge_applies_them(q):
    """Phorge's testTooManyTaskFailures retries with -60: the lease expired a minute ago,
    so the task is due at once; a yield lasts at least 5 s, however short it asks."""
    failed, yielded = leased_task(q), leased_task(q)
    assert outcomes.fail_temporary(q, failed.id, failed.lease_owner, -60)
    assert outcomes.yield_(q, yielded.id, yielded.lease_owner, -60)
    now = q.server_time()
    assert q.get(failed.id).lease_expires - now in (-60, -61)
    assert q.get(yielded.id).lease_expires - now in (5, 4)
    [again] = q.lease(1, owner_prefix="test", ids=[failed.id])
    assert (again.id, again.failure_count) == (failed.id, 1)


# -- payloads: any JSON value, exactly, as PHP reads it ------------------------------------


@pytest.mark.parametrize(
    "data, stored",
    [
        ({"key": BIG_KEY}, '{"key":7713765376809813936}'),
        (2, "2"),  # PhabricatorMetaMTAWorker: the bare mail id
        ("text", '"text"'),
        (None, "null"),
        ([], "[]"),
        ([1, [2, {"x": -(2**63)}]], '[1,[2,{"x":-9223372036854775808}]]'),
        ({"to": ["a", "b"], "ok": True, "n": None}, '{"to":["a","b"],"ok":true,"n":null}'),
        ({"é": "ü 😀"}, '{"\\u00e9":"\\u00fc \\ud83d\\ude00"}'),  # as PHP's json_encode
    ],
)
def test_payloads_round_trip_exactly(q, data, stored):
    task_id = q.enqueue(WORKER, data)
    assert data_text(q, task_id) == stored
    [task] = q.lease(1, owner_prefix="test")
    assert task.data == data and task.data_error is None
    assert type(task.data) is type(data)
    assert q.get(task_id).data == data


def test_a_corrupt_data_row_is_reported_on_that_task(q):
    good, corrupt, orphan, last = (q.enqueue(WORKER, {"n": n}) for n in range(4))
    bad_id, orphan_id = active_row(q, corrupt).dataID, active_row(q, orphan).dataID
    with q.engine.begin() as conn:
        conn.execute(update(taskdata).where(taskdata.c.id == bad_id).values(data='{"n": '))
        conn.execute(taskdata.delete().where(taskdata.c.id == orphan_id))

    tasks = {t.id: t for t in q.lease(10, owner_prefix="test")}

    assert sorted(tasks) == [good, corrupt, orphan, last]
    assert (tasks[corrupt].data, tasks[corrupt].raw_data) == (None, '{"n": ')
    assert "JSON" in tasks[corrupt].data_error
    assert tasks[orphan].data is None and "missing" in tasks[orphan].data_error
    assert [(tasks[i].data, tasks[i].data_error) for i in (good, last)] == [
        ({"n": 0}, None),
        ({"n": 3}, None),
    ]
    assert q.get(corrupt).data_error == tasks[corrupt].data_error
    with q.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(taskdata)).scalar() == 3
