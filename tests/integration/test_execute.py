"""``bridge.execute`` in process, on MariaDB: fencing, outcomes, heartbeat, guarded reporting.

``run_task`` is called directly with a Runtime built from ``load_settings``, which is
faster and more precise than a worker subprocess wherever the worker is not the point.
Time passes by rewriting ``leaseExpires`` against the database clock, except where
the heartbeat's own timer is under test.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import MySQLdb
import pytest
from bad_rows import corrupt_data
from celery.exceptions import Retry
from flaky_sql import flaky, flaky_statement
from prometheus_client import REGISTRY
from sqlalchemy import Engine, event, select, update

from bridge import errors
from bridge.canary.weights import labelled
from bridge.celery import app
from bridge.config import load_settings
from bridge.engine.batch import backoff, run_task
from bridge.engine.context import Runtime
from bridge.errors import DatabaseUnavailable
from bridge.handlers.api import Handler, PermanentFailure, TaskContext, TemporaryFailure, Yield
from bridge.handlers.phabricator import PhabricatorTestWorker
from bridge.handlers.registry import Registry
from bridge.metrics import count_runs
from bridge.queue import Lease, OperatorActions, Outcome, PhorgeQueue, make_engine
from bridge.queue import retry as retry_module
from bridge.queue import statements as sql
from bridge.queue.dialect import db_now
from bridge.queue.model import (
    DEFAULT_RETRY_WAIT,
    PRIORITY_DEFAULT,
    RESULT_FAILURE,
    RESULT_SUCCESS,
    YIELD_OWNER,
    NewTask,
    TaskFilter,
)
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive
from bridge.queue.schema import worker_taskdata as taskdata
from bridge.queue.session import LeaseSession
from bridge.runtime import tasks as execute_module
from bridge.runtime.dispatch import EXECUTE_BATCH, EXECUTE_TASK, Sent

pytestmark = pytest.mark.mariadb

TEST_WORKER = "PhabricatorTestWorker"
PROBE = "BridgeProbeWorker"
RETRY_BASE, RETRY_MAX = 15, 3600
REPORT_ATTEMPTS = 3


class Probe(Handler):
    """A handler whose behaviour each test sets; it remembers every run."""

    task_classes = (PROBE,)

    def __init__(self) -> None:
        self.runs: list[TaskContext] = []
        self.behaviour: Callable[[TaskContext], None] = lambda task: None
        self.lease: int | None = None
        self.wait: int | None = None

    def required_lease(self, task: TaskContext) -> int | None:
        return self.lease

    def wait_before_retry(self, task: TaskContext) -> int | None:
        return self.wait

    def run(self, task: TaskContext) -> None:
        self.runs.append(task)
        self.behaviour(task)


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def rt(mysql_engine: Engine, probe: Probe) -> Iterator[Runtime]:
    url = mysql_engine.url.render_as_string(hide_password=False)
    settings = load_settings(
        {
            "BRIDGE_DATABASE_URL": url,
            "BRIDGE_BROKER_URL": "amqp://unused//",
            "BRIDGE_RETRY_BASE": str(RETRY_BASE),
            "BRIDGE_RETRY_MAX": str(RETRY_MAX),
            "BRIDGE_RETRY_JITTER": "0",
            "BRIDGE_REPORT_ATTEMPTS": str(REPORT_ATTEMPTS),
        }
    )
    registry = Registry([PhabricatorTestWorker(), probe])
    count_runs()  # the renewals are counted by the metrics' observer, as in a worker
    runtime = Runtime(settings, PhorgeQueue(make_engine(url), REPORT_ATTEMPTS), registry)
    yield runtime
    runtime.queue.engine.dispose()


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The backoff sleeps of the database retry policy, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(retry_module, "time", SimpleNamespace(sleep=slept.append))
    return slept


# -- helpers -------------------------------------------------------------------------------


def warm_run_locks(rt: Runtime) -> None:
    """Make the run locks' connection, as a worker's first run does: it is the
    process's, like the session's, so a run costs no pool checkout."""
    warm = Lease(0, "warm", 0)
    rt.runs.hold([warm])
    rt.runs.release([warm])


def queue_and_lease(rt: Runtime, task_class: str, data=None, seconds: int = 300, **options):
    """Enqueue one task and lease it as a poll would; returns the leased Task."""
    task_id = rt.queue.enqueue(task_class, data, **options)
    [task] = rt.queue.lease(1, seconds, classes=[task_class])
    assert task.id == task_id
    return task


def active_row(rt: Runtime, task_id: int):
    with rt.queue.engine.connect() as conn:
        return conn.execute(select(active).where(active.c.id == task_id)).first()


def archive_rows(rt: Runtime, task_id: int) -> list:
    with rt.queue.engine.connect() as conn:
        return conn.execute(select(archive).where(archive.c.id == task_id)).all()


def set_active(rt: Runtime, task_id: int, **values) -> None:
    """Rewrite columns of an active row (``leaseExpires=db_now() - 1`` expires a lease)."""
    with rt.queue.engine.begin() as conn:
        conn.execute(update(active).where(active.c.id == task_id).values(**values))


def now(rt: Runtime) -> int:
    return rt.queue.server_time()


class SessionCost:
    """COMMITs and statements the per-task session sends, and pool checkouts, from now on.

    Counted by the server for the session's own connection (``SHOW SESSION STATUS``),
    so statements sent as one multi-statement round trip are all seen.
    """

    def __init__(self, rt: Runtime) -> None:
        self.session = rt.queue.session
        self.before = self._status()
        self.checkouts = 0
        event.listen(rt.queue.engine, "checkout", self._checked_out)

    def _checked_out(self, *_args) -> None:
        self.checkouts += 1

    def _status(self) -> dict[str, int]:
        cursor = self.session._dbapi().cursor()
        cursor.execute("SHOW SESSION STATUS WHERE Variable_name IN ('Com_commit', 'Questions')")
        status = {name: int(value) for name, value in cursor.fetchall()}
        cursor.close()
        return status

    def since(self) -> dict[str, int]:
        after = self._status()
        # The first SHOW counts once in Questions.
        return {
            "commits": after["Com_commit"] - self.before["Com_commit"],
            "statements": after["Questions"] - self.before["Questions"] - 1,
            "checkouts": self.checkouts,
        }


def renewals(result: str) -> float:
    return REGISTRY.get_sample_value("phorge_bridge_lease_renewals_total", {"result": result}) or 0


# -- success and its cost ------------------------------------------------------------------


@pytest.mark.parametrize("inline", [True, False], ids=["data-in-message", "data-from-db"])
def test_a_short_task_costs_one_commit_its_outcome(rt, inline):
    task = queue_and_lease(rt, TEST_WORKER, {"duration": 0})
    warm_run_locks(rt)
    cost = SessionCost(rt)
    outcome = run_task(rt, task.lease, task.raw_data if inline else None).outcome
    assert outcome is Outcome.SUCCESS
    # The check, then START TRANSACTION, archive, delete, COMMIT (one round trip),
    # on the session's own connection: no pool checkout.
    assert cost.since() == {"commits": 1, "statements": 5, "checkouts": 0}
    [row] = archive_rows(rt, task.id)
    assert (row.result, row.leaseOwner) == (RESULT_SUCCESS, labelled(task.lease_owner, "native"))
    assert active_row(rt, task.id) is None


def test_a_required_lease_beyond_the_dispatch_lease_is_claimed_before_running(rt, probe):
    probe.lease = 3600
    task = queue_and_lease(rt, PROBE, seconds=60)
    seen = []
    probe.behaviour = lambda ctx: seen.append(active_row(rt, ctx.id).leaseExpires - now(rt))
    cost = SessionCost(rt)
    assert run_task(rt, task.lease).outcome is Outcome.SUCCESS
    assert seen[0] >= 3600 - 1
    assert cost.since()["commits"] == 2, "one claim, one outcome"


def celery_execute() -> Any:
    """``bridge.execute`` as the app registered it."""
    return app.tasks[EXECUTE_TASK]


def celery_execute_batch() -> Any:
    return app.tasks[EXECUTE_BATCH]


def test_the_celery_task_reports_its_outcome_by_label(rt, monkeypatch):
    task = queue_and_lease(rt, TEST_WORKER)
    monkeypatch.setattr(execute_module, "runtime", lambda: rt)
    result = celery_execute()(*task.lease, task.raw_data, TEST_WORKER)
    assert result == f"{TEST_WORKER}#{task.id} [native]: success"


def test_the_celery_task_raises_what_celery_records_as_its_state(rt, monkeypatch):
    """RETRY for a temporary failure, which Phorge retries after its wait; FAILURE with
    the reason for lost leases; a yield is a SUCCESS that says how to find its next run."""
    monkeypatch.setattr(execute_module, "runtime", lambda: rt)
    task = queue_and_lease(rt, TEST_WORKER, {"doWork": "fail-temporary", "getWaitBeforeRetry": 60})
    label = f"{TEST_WORKER}#{task.id}"
    with pytest.raises(Retry) as failed:
        celery_execute()(*task.lease, task.raw_data, TEST_WORKER)
    reason = f"{label} [native]: failure: Temporary failure! (due again in 60 s)"
    assert (str(failed.value), failed.value.when) == (reason, 60)
    assert isinstance(failed.value.exc, errors.TaskFailed) and str(failed.value.exc) == reason
    with pytest.raises(errors.LeaseLost) as lost:
        celery_execute()(*task.lease, task.raw_data, TEST_WORKER)
    assert str(lost.value).startswith(f"{label}: lease-lost: the lease was no longer held")

    task = queue_and_lease(rt, TEST_WORKER, {"doWork": "yield", "yieldUntil": time.time() + 60})
    result = celery_execute()(*task.lease, task.raw_data, TEST_WORKER)
    assert result.startswith(f"{TEST_WORKER}#{task.id} [native]: yield (due again in 6")
    assert result.endswith(f"; runs again in a new message: search kwargs:{task.id}={TEST_WORKER}")
    assert celery_execute().throws == (errors.TaskNotDone,)


# -- the fence: a lease that is no longer ours changes nothing -----------------------------


@pytest.mark.parametrize("re_leased", [True, False], ids=["re-leased", "expired"])
def test_a_message_for_a_lost_lease_changes_nothing(rt, probe, re_leased):
    task = queue_and_lease(rt, PROBE)
    set_active(rt, task.id, leaseExpires=db_now() - 1)
    if re_leased:
        [again] = rt.queue.lease(1, 300, classes=[PROBE])
        assert again.id == task.id
    before = active_row(rt, task.id)

    assert run_task(rt, task.lease, task.raw_data).outcome is Outcome.LEASE_LOST
    assert probe.runs == []
    assert active_row(rt, task.id) == before
    assert archive_rows(rt, task.id) == []


def test_a_lease_lost_while_running_writes_nothing_and_queues_no_followups(rt, probe):
    task = queue_and_lease(rt, PROBE)

    def lose_the_lease(ctx: TaskContext) -> None:
        ctx.queue_task(TEST_WORKER, {"child": True})
        set_active(rt, ctx.id, leaseOwner="someone-else", leaseExpires=db_now() + 300)

    probe.behaviour = lose_the_lease
    assert run_task(rt, task.lease).outcome is Outcome.LEASE_LOST
    assert active_row(rt, task.id).leaseOwner == "someone-else"
    assert archive_rows(rt, task.id) == []
    assert rt.queue.list(TaskFilter(classes=[TEST_WORKER])) == []


# -- failures, retries, yields ---------------------------------------------------------------


def test_a_temporary_failure_waits_as_declared_and_keeps_the_owner_labelled(rt):
    """The failed run's owner stays, labelled with who ran it, as its archive row would
    be: the canary guard reads whose failure it was while the row waits."""
    data = {"doWork": "fail-temporary", "getWaitBeforeRetry": 42}
    task = queue_and_lease(rt, TEST_WORKER, data)
    assert run_task(rt, task.lease).outcome is Outcome.FAILURE
    row = active_row(rt, task.id)
    assert (row.failureCount, row.leaseOwner) == (1, labelled(task.lease_owner, "native"))
    assert row.leaseExpires - row.failureTime == 42
    # Phorge's phase 2 takes it back by that owner once the wait is over.
    set_active(rt, task.id, leaseExpires=row.failureTime - 1)
    [again] = rt.queue.lease(1, ids=[task.id])
    assert again.failure_count == 1


@pytest.mark.parametrize(
    ("failures", "wait"), [(0, RETRY_BASE), (3, RETRY_BASE * 8), (20, RETRY_MAX)]
)
def test_without_a_declared_wait_the_backoff_doubles_up_to_its_cap(rt, probe, failures, wait):
    """For handlers of classes Phorge does not have."""
    probe.behaviour = fail_temporarily
    task = queue_and_lease(rt, PROBE)
    set_active(rt, task.id, failureCount=failures)
    assert run_task(rt, task.lease._replace(failure_count=failures)).outcome is Outcome.FAILURE
    row = active_row(rt, task.id)
    assert row.leaseExpires - row.failureTime == wait


def fail_temporarily(ctx: TaskContext) -> None:
    raise RuntimeError("Temporary failure!")


@pytest.mark.parametrize("failures", [0, 3])
def test_a_phorge_class_without_a_declared_wait_waits_phorges_flat_300_seconds(rt, failures):
    task = queue_and_lease(rt, TEST_WORKER, {"doWork": "fail-temporary"})
    set_active(rt, task.id, failureCount=failures)
    assert run_task(rt, task.lease._replace(failure_count=failures)).outcome is Outcome.FAILURE
    row = active_row(rt, task.id)
    assert row.leaseExpires - row.failureTime == DEFAULT_RETRY_WAIT


def test_a_negative_wait_makes_the_task_due_at_once_as_in_phorge(rt):
    """Phorge's testTooManyTaskFailures: getWaitBeforeRetry -60 leaves leaseExpires = now-60."""
    data = {"doWork": "fail-temporary", "getWaitBeforeRetry": -60}
    task = queue_and_lease(rt, TEST_WORKER, data)
    assert run_task(rt, task.lease).outcome is Outcome.FAILURE
    row = active_row(rt, task.id)
    assert row.leaseExpires - row.failureTime == -60
    again = rt.queue.lease(1, ids=[task.id])
    assert [(t.id, t.failure_count) for t in again] == [(task.id, 1)]


def test_a_negative_yield_holds_the_task_phorges_minimum_5_seconds(rt, probe):
    def yield_(ctx: TaskContext) -> None:
        raise Yield(delay=-60)

    probe.behaviour = yield_
    task = queue_and_lease(rt, PROBE)
    assert run_task(rt, task.lease).outcome is Outcome.YIELD
    row = active_row(rt, task.id)
    assert row.leaseOwner == YIELD_OWNER
    assert row.leaseExpires - now(rt) in (5, 4)


def test_a_declared_lease_is_set_even_when_shorter_as_php_sets_it(rt, probe):
    seen: list[int] = []
    probe.lease = 60
    probe.behaviour = lambda ctx: seen.append(active_row(rt, ctx.id).leaseExpires - now(rt))
    task = queue_and_lease(rt, PROBE, seconds=300)
    assert run_task(rt, task.lease).outcome is Outcome.SUCCESS
    assert seen[0] in (60, 59)


def test_backoff_jitter_stays_within_its_fraction(rt):
    jittered = Runtime(
        load_settings({"BRIDGE_RETRY_BASE": "100", "BRIDGE_RETRY_JITTER": "0.5"}),
        rt.queue,
        rt.registry,
    )
    waits = {backoff(jittered, 0) for _ in range(200)}
    assert min(waits) >= 100 and max(waits) <= 150 and len(waits) > 1


def test_a_temporary_failure_may_carry_its_own_wait(rt, probe):
    probe.wait = 600

    def fail(ctx: TaskContext) -> None:
        raise TemporaryFailure("remote busy", delay=7)

    probe.behaviour = fail
    task = queue_and_lease(rt, PROBE)
    assert run_task(rt, task.lease).outcome is Outcome.FAILURE
    row = active_row(rt, task.id)
    assert row.leaseExpires - row.failureTime == 7


@pytest.mark.parametrize(("failures", "runs"), [(2, True), (3, False)])
def test_past_the_maximum_retry_count_the_task_fails_permanently_unrun(rt, failures, runs):
    data = {"doWork": "fail-temporary", "getMaximumRetryCount": 2, "getWaitBeforeRetry": 1}
    task = queue_and_lease(rt, TEST_WORKER, data)
    set_active(rt, task.id, failureCount=failures)
    outcome = run_task(rt, task.lease._replace(failure_count=failures)).outcome
    if runs:
        assert outcome is Outcome.FAILURE
        assert active_row(rt, task.id).failureCount == 3
    else:
        assert outcome is Outcome.PERMANENT_FAILURE
        [row] = archive_rows(rt, task.id)
        assert (row.result, row.failureCount) == (RESULT_FAILURE, 3)


def test_a_permanent_failure_is_archived_as_result_1_with_its_reason_logged(rt, caplog):
    task = queue_and_lease(rt, TEST_WORKER, {"doWork": "fail-permanent"})
    with caplog.at_level(logging.WARNING):
        assert run_task(rt, task.lease).outcome is Outcome.PERMANENT_FAILURE
    [row] = archive_rows(rt, task.id)
    assert (row.result, row.duration) == (RESULT_FAILURE, 0)
    assert f"task {task.id} failed permanently: Permanent failure!" in caplog.text


@pytest.mark.parametrize(("seconds", "held_for"), [(2, 5), (60, 60)])
def test_a_yield_hands_the_task_back_for_its_duration_without_a_failure(
    rt, probe, seconds, held_for
):
    def yield_(ctx: TaskContext) -> None:
        raise Yield(delay=seconds)

    probe.behaviour = yield_
    task = queue_and_lease(rt, PROBE)
    assert run_task(rt, task.lease).outcome is Outcome.YIELD
    row = active_row(rt, task.id)
    assert (row.leaseOwner, row.failureCount) == (YIELD_OWNER, 0)
    assert row.leaseExpires - now(rt) in (held_for, held_for - 1)


def raise_lookup_error(task: TaskContext) -> int:
    raise LookupError("no policy for this task")


@pytest.mark.parametrize(
    ("data", "broken_hook", "outcome"),
    [
        ({"doWork": "fail-temporary", "getWaitBeforeRetry": "soon"}, None, Outcome.FAILURE),
        ({"getRequiredLeaseTime": "1h"}, None, Outcome.SUCCESS),
        ({"getMaximumRetryCount": "three"}, None, Outcome.SUCCESS),
        ({"doWork": "fail-temporary"}, "wait_before_retry", Outcome.FAILURE),
        ({}, "required_lease", Outcome.SUCCESS),
        ({}, "maximum_retry_count", Outcome.SUCCESS),
    ],
    ids=["wait-value", "lease-value", "retries-value", "wait-hook", "lease-hook", "retries-hook"],
)
def test_an_unusable_policy_falls_back_to_the_default_and_the_run_is_reported(
    rt, monkeypatch, data, broken_hook, outcome
):
    """Else the run raises, nothing is counted, and the task loops forever, lease after lease."""
    if broken_hook:
        handler = rt.registry.handler_for(TEST_WORKER)
        monkeypatch.setattr(handler, broken_hook, raise_lookup_error)
    task = queue_and_lease(rt, TEST_WORKER, data)
    assert run_task(rt, task.lease).outcome is outcome
    if outcome is Outcome.FAILURE:
        row = active_row(rt, task.id)
        assert row.failureCount == 1
        assert row.leaseExpires - row.failureTime == DEFAULT_RETRY_WAIT


# -- follow-ups -------------------------------------------------------------------------------


def test_followups_are_queued_once_on_success_with_the_parents_priority(rt, probe):
    def queue_two(ctx: TaskContext) -> None:
        ctx.queue_task(TEST_WORKER, {"n": 1})
        ctx.queue_task(TEST_WORKER, {"n": 2}, priority=4000)
        if ctx.failure_count == 0:
            raise RuntimeError("first run fails after queueing")

    probe.behaviour = queue_two
    task = queue_and_lease(rt, PROBE, priority=1500)
    assert run_task(rt, task.lease).outcome is Outcome.FAILURE
    assert rt.queue.list(TaskFilter(classes=[TEST_WORKER])) == [], "queued by a failed run"

    set_active(rt, task.id, leaseExpires=db_now() - 1)
    [again] = rt.queue.lease(1, 300, classes=[PROBE])
    assert run_task(rt, again.lease).outcome is Outcome.SUCCESS
    followups = rt.queue.list(TaskFilter(classes=[TEST_WORKER]))
    assert sorted((t.data["n"], t.priority) for t in followups) == [(1, 1500), (2, 4000)]
    assert all(t.id > task.id and t.lease_owner is None for t in followups)


def test_followups_of_a_default_priority_parent_get_the_default(rt):
    data = {"followups": [{"taskClass": PROBE, "data": {}}]}
    task = queue_and_lease(rt, TEST_WORKER, data)
    assert run_task(rt, task.lease).outcome is Outcome.SUCCESS
    [followup] = rt.queue.list(TaskFilter(classes=[PROBE]))
    assert followup.priority == PRIORITY_DEFAULT


# -- data that cannot be used ------------------------------------------------------------------


def corrupt(rt: Runtime, task_id: int, text: str | None) -> None:
    with rt.queue.engine.begin() as conn:
        data_id = active_row(rt, task_id).dataID
        if text is None:
            conn.execute(taskdata.delete().where(taskdata.c.id == data_id))
        else:
            conn.execute(update(taskdata).where(taskdata.c.id == data_id).values(data=text))


@pytest.mark.parametrize(
    ("stored", "inline", "reason"),
    [
        ('{"duration": ', None, "the task's data row is not valid JSON"),
        ("{}", '{"duration": ', "the task's data row is not valid JSON"),
        (None, None, "the task's data row is missing"),
        ("[NaN]", None, "the task's data row is not valid JSON"),
    ],
    ids=["corrupt-row", "corrupt-message", "missing-row", "php-rejects-nan"],
)
def test_unusable_task_data_fails_permanently_with_a_clear_reason(
    rt, probe, caplog, stored, inline, reason
):
    task = queue_and_lease(rt, PROBE, {})
    corrupt(rt, task.id, stored)
    with caplog.at_level(logging.WARNING):
        assert run_task(rt, task.lease, inline).outcome is Outcome.PERMANENT_FAILURE
    assert probe.runs == []
    [row] = archive_rows(rt, task.id)
    assert row.result == RESULT_FAILURE
    assert f"task {task.id} failed permanently: {reason}" in caplog.text


def test_a_class_no_longer_served_is_handed_back_at_once(rt):
    task = queue_and_lease(rt, "PhabricatorSearchWorker")
    assert run_task(rt, task.lease).outcome is Outcome.NOT_SERVED
    row = active_row(rt, task.id)
    assert (row.leaseOwner, row.leaseExpires) == (None, None)


# -- the heartbeat -------------------------------------------------------------------------------


SHORT_LEASE = 3  # the heartbeat beats every third of it: once a second


def test_the_heartbeat_renews_the_lease_of_a_long_task(rt, probe):
    task = queue_and_lease(rt, PROBE, seconds=SHORT_LEASE)
    first_expiry = task.lease_expires
    expiries = []

    def run_long(ctx: TaskContext) -> None:
        for _ in range(3):
            time.sleep(1)
            expiries.append(active_row(rt, ctx.id).leaseExpires)

    probe.behaviour = run_long
    assert run_task(rt, task.lease).outcome is Outcome.SUCCESS
    assert expiries[-1] > first_expiry + 1
    assert archive_rows(rt, task.id)[0].result == RESULT_SUCCESS


def test_a_renewal_that_finds_the_lease_lost_means_the_result_is_never_written(rt, probe):
    task = queue_and_lease(rt, PROBE, seconds=SHORT_LEASE)
    lost_before = renewals("lost")

    def lose_then_regain(ctx: TaskContext) -> None:
        # Expired for one heartbeat (someone could have leased and run it meanwhile)...
        set_active(rt, ctx.id, leaseExpires=db_now() - 1)
        deadline = time.monotonic() + 30  # a condition wait: generous on a loaded host
        while renewals("lost") == lost_before and time.monotonic() < deadline:
            time.sleep(0.05)
        # ...then ours again: the outcome write alone would now succeed.
        set_active(rt, ctx.id, leaseExpires=db_now() + 300)

    probe.behaviour = lose_then_regain
    assert run_task(rt, task.lease).outcome is Outcome.LEASE_LOST
    assert renewals("lost") == lost_before + 1
    row = active_row(rt, task.id)
    assert (row.leaseOwner, row.failureCount) == (task.lease_owner, 0)
    assert archive_rows(rt, task.id) == []


def test_a_database_blip_during_a_renewal_is_retried_not_fatal(rt, probe, monkeypatch):
    unavailable = lambda: DatabaseUnavailable("renew: gone")  # noqa: E731
    monkeypatch.setattr(LeaseSession, "renew", flaky(LeaseSession.renew, 1, unavailable))
    errors_before = renewals("error")
    task = queue_and_lease(rt, PROBE, seconds=SHORT_LEASE)
    # Past the first lease: only the second beat's renewal keeps the task ours.
    probe.behaviour = lambda ctx: time.sleep(SHORT_LEASE + 0.5)
    assert run_task(rt, task.lease).outcome is Outcome.SUCCESS
    assert renewals("error") == errors_before + 1
    assert archive_rows(rt, task.id)[0].result == RESULT_SUCCESS


# -- reporting through database errors -------------------------------------------------------------


def test_transient_errors_while_reporting_are_retried_with_backoff(rt, sleeps, monkeypatch):
    flaky_statement(monkeypatch, sql.ARCHIVE, failures=2)
    task = queue_and_lease(rt, TEST_WORKER)
    assert run_task(rt, task.lease).outcome is Outcome.SUCCESS
    assert len(archive_rows(rt, task.id)) == 1
    assert len(sleeps) == 2 and sleeps[0] < sleeps[1]


def test_after_the_bounded_attempts_the_lease_is_left_to_expire(rt, sleeps, monkeypatch, caplog):
    flaky_statement(monkeypatch, sql.FAIL_TEMPORARY, failures=99)
    task = queue_and_lease(rt, TEST_WORKER, {"doWork": "fail-temporary"})
    before = active_row(rt, task.id)
    with caplog.at_level(logging.WARNING):
        assert run_task(rt, task.lease).outcome is Outcome.UNREPORTED
    assert len(sleeps) == REPORT_ATTEMPTS - 1
    assert active_row(rt, task.id) == before, "the lease was touched"
    assert "not written; the lease will expire" in caplog.text


def test_a_redelivered_dispatch_does_not_rerun_a_task_waiting_to_retry(rt, probe):
    def fail(ctx: TaskContext) -> None:
        raise TemporaryFailure("down", delay=600)

    probe.behaviour = fail
    task = queue_and_lease(rt, PROBE)
    assert run_task(rt, task.lease).outcome is Outcome.FAILURE
    # The broker redelivers the same message: same owner, lease (the wait) unexpired.
    assert run_task(rt, task.lease).outcome is Outcome.LEASE_LOST
    assert len(probe.runs) == 1
    assert active_row(rt, task.id).failureCount == 1


def test_a_non_utf8_data_row_fails_that_task_permanently(rt):
    task_id = rt.queue.enqueue(TEST_WORKER, {})
    corrupt_data(rt.queue, task_id)
    [task] = rt.queue.lease(1, 300)
    assert run_task(rt, task.lease).outcome is Outcome.PERMANENT_FAILURE
    assert archive_rows(rt, task_id)[0].result == RESULT_FAILURE


# -- batches: a backlog's tasks several to a Celery message ----------------------------------


def lease_batch(rt: Runtime, task_class: str, count: int, data=None) -> tuple[str, list]:
    """Enqueue and lease ``count`` tasks under one owner, as one poll does; returns the
    owner and the ``bridge.execute_batch`` items."""
    rt.queue.enqueue_many([NewTask(task_class, data)] * count)
    tasks = rt.queue.lease(count, 300, classes=[task_class])
    assert len(tasks) == count
    return tasks[0].lease_owner, [[t.id, t.failure_count, t.task_class, t.raw_data] for t in tasks]


@pytest.fixture
def batches(rt, monkeypatch) -> list[tuple[list, int]]:
    """Run ``bridge.execute_batch`` on ``rt``; what a batch sends on is recorded here,
    ``size`` tasks a message, the messages' ids ``m0``, ``m1``, ... A batch's time budget
    (its poll interval) is a minute, which no loaded machine spends on these tasks: only
    the test of the budget sets it short."""
    sent: list[tuple[list, int]] = []
    rt.settings = replace(rt.settings, poll_interval=60)
    monkeypatch.setattr(execute_module, "runtime", lambda: rt)

    def send_messages(_app, owner, rest, queue, size, sent_on=False) -> list[Sent]:
        assert sent_on, "tasks a batch sends on are counted apart from dispatches"
        sent.append((rest, size))
        groups = [rest[at : at + size] for at in range(0, len(rest), size)]
        return [Sent(EXECUTE_TASK, f"m{n}", group) for n, group in enumerate(groups)]

    monkeypatch.setattr(execute_module, "send_messages", send_messages)
    return sent


def test_a_batch_costs_one_round_trip_a_task_and_a_commit_each(rt, batches):
    owner, items = lease_batch(rt, TEST_WORKER, 8)
    warm_run_locks(rt)
    cost = SessionCost(rt)
    ids = ", ".join(f"#{task_id}" for task_id, *_ in items)
    assert celery_execute_batch()(owner, items) == f"8 task(s): 8 success ({ids})"
    # The first check; then 7 round trips of the previous outcome (START TRANSACTION,
    # archive, delete, COMMIT) and the next check; then the last outcome alone.
    assert cost.since() == {"commits": 8, "statements": 1 + 7 * 5 + 4, "checkouts": 0}
    for task_id, *_ in items:
        assert [row.result for row in archive_rows(rt, task_id)] == [RESULT_SUCCESS]
        assert active_row(rt, task_id) is None


def test_a_task_cancelled_while_its_batch_runs_does_not_run(rt, probe, batches):
    owner, items = lease_batch(rt, PROBE, 3)
    first, second, third = (item[0] for item in items)

    def cancel_the_second(ctx: TaskContext) -> None:
        if ctx.id == first:
            OperatorActions(rt.queue).cancel(TaskFilter(ids=[second]))

    probe.behaviour = cancel_the_second
    with pytest.raises(errors.BatchNotDone) as not_done:
        celery_execute_batch()(owner, items)
    assert [ctx.id for ctx in probe.runs] == [first, third]
    assert f"{PROBE}#{second}: lease-lost: the lease was no longer held" in str(not_done.value)
    assert str(not_done.value).startswith(
        f"3 task(s): 1 lease-lost (#{second}), 2 success (#{first}, #{third}); "
    )
    assert [row.result for row in archive_rows(rt, third)] == [RESULT_SUCCESS]


def test_each_outcome_in_a_batch_is_fenced_alone(rt, probe, batches):
    owner, items = lease_batch(rt, PROBE, 3)
    first, second, third = (item[0] for item in items)

    def behave(ctx: TaskContext) -> None:
        if ctx.id == first:  # another consumer took this one meanwhile
            set_active(rt, first, leaseOwner="someone-else", leaseExpires=db_now() + 300)
        if ctx.id == second:
            raise TemporaryFailure("down", delay=60)

    probe.behaviour = behave
    with pytest.raises(errors.BatchNotDone) as not_done:
        celery_execute_batch()(owner, items)
    assert f"{PROBE}#{first} [native]: lease-lost: success not written" in str(not_done.value)
    assert f"{PROBE}#{second} [native]: failure: down (due again in 60 s)" in str(not_done.value)
    assert active_row(rt, first).leaseOwner == "someone-else"
    assert active_row(rt, second).failureCount == 1
    assert [row.result for row in archive_rows(rt, third)] == [RESULT_SUCCESS]


@pytest.mark.parametrize(
    ("third", "ended"),
    [("succeeds", Retry), ("fails for good", errors.BatchNotDone)],
)
def test_a_batch_retries_when_its_only_failures_are_temporary(rt, probe, batches, third, ended):
    owner, items = lease_batch(rt, PROBE, 3)
    _, second, last = (item[0] for item in items)

    def behave(ctx: TaskContext) -> None:
        if ctx.id == second:
            raise TemporaryFailure("down", delay=60)
        if ctx.id == last and third == "fails for good":
            raise PermanentFailure("bad address")

    probe.behaviour = behave
    with pytest.raises(ended) as not_done:
        celery_execute_batch()(owner, items)
    text = str(not_done.value)
    assert text.startswith("3 task(s): ")
    assert f"{PROBE}#{second} [native]: failure: down (due again in 60 s)" in text
    # The reason is the handler's, raised where it failed.
    assert str(not_done.value.__cause__) == "down"
    assert active_row(rt, second).failureCount == 1


def test_a_batch_past_its_poll_interval_sends_the_rest_on_unrun(rt, probe, batches):
    owner, items = lease_batch(rt, PROBE, 5)
    rt.settings = replace(rt.settings, poll_interval=0.25)
    probe.behaviour = lambda ctx: time.sleep(rt.settings.poll_interval * 1.5)
    ids = [task_id for task_id, *_ in items]
    assert celery_execute_batch()(owner, items) == (
        f"1 task(s): 1 success (#{ids[0]}); 4 sent on: "
        + ", ".join(f"bridge.execute[m{n}] (#{task_id})" for n, task_id in enumerate(ids[1:]))
    )
    # One task took longer than the interval: the rest go one a message, still leased.
    [(rest, size)] = batches
    assert [item.id for item in rest] == [item[0] for item in items[1:]]
    assert size == 1
    assert [ctx.id for ctx in probe.runs] == [items[0][0]]
    assert {active_row(rt, item.id).leaseOwner for item in rest} == {owner}


def test_a_refused_outcome_fails_alone_and_the_batch_goes_on(rt, batches, monkeypatch, caplog):
    owner, items = lease_batch(rt, TEST_WORKER, 3)
    refused = MySQLdb.DataError(1264, "Out of range value for column 'duration'")
    # Refused with the next task's check, then alone: the first outcome only.
    flaky_statement(monkeypatch, sql.ARCHIVE, failures=2, error=lambda: refused)
    with caplog.at_level(logging.ERROR), pytest.raises(errors.BatchNotDone) as not_done:
        celery_execute_batch()(owner, items)
    first, second, third = (item[0] for item in items)
    assert f"{TEST_WORKER}#{first} [native]: unreported: success not written" in str(not_done.value)
    assert "Out of range value" in caplog.text
    assert archive_rows(rt, first) == [] and active_row(rt, first).leaseOwner == owner
    for task_id in (second, third):
        assert [row.result for row in archive_rows(rt, task_id)] == [RESULT_SUCCESS]


def test_a_database_outage_mid_batch_leaves_the_rest_to_their_leases(
    rt, probe, batches, sleeps, monkeypatch
):
    owner, items = lease_batch(rt, PROBE, 3, data={"n": 1})
    flaky_statement(monkeypatch, sql.HELD, failures=99)
    with pytest.raises(errors.BatchNotDone) as not_done:
        celery_execute_batch()(owner, items)
    ids = ", ".join(f"#{task_id}" for task_id, *_ in items)
    assert str(not_done.value).startswith(f"3 task(s): 3 unreported ({ids}); ")
    assert probe.runs == []
    assert {active_row(rt, item[0]).leaseOwner for item in items} == {owner}
