"""A database that refuses writes, on MariaDB: nothing starts, nothing runs twice.

The runtime connects as the account docs/operating.md recommends (SELECT, INSERT,
UPDATE, DELETE on the queue's database), which ``read_only`` binds, while the test's
own connection (SUPER) turns it on and off. Faults the server cannot make on cue (a
full table, a deadlock at one statement, a connection lost just after its COMMIT) are
injected at the driver, against the real server.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import MySQLdb
import MySQLdb.cursors
import pytest
from click.testing import CliRunner
from flaky_sql import flaky_statement
from sqlalchemy import Engine, select

from bridge.canary.weights import labelled
from bridge.cli.main import main
from bridge.config import load_settings
from bridge.engine.batch import Batch, run_task
from bridge.engine.context import Runtime
from bridge.engine.poll import poll_once
from bridge.handlers.api import Handler, PermanentFailure, TaskContext, TemporaryFailure, Yield
from bridge.handlers.registry import Registry
from bridge.queue import Outcome, PhorgeQueue, Task, make_engine
from bridge.queue import statements as sql
from bridge.queue.model import YIELD_OWNER, Leased, NewTask, TaskFilter
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive

pytestmark = pytest.mark.mariadb

PROBE = "WriteProbeWorker"
READ_ONLY_ERROR = "running with the --read-only option"


class Probe(Handler):
    """Runs each test's ``behaviour`` and remembers when each run started."""

    task_classes = (PROBE,)

    def __init__(self) -> None:
        self.started: list[tuple[int, float]] = []
        self.behaviour: Callable[[TaskContext], None] = lambda task: None

    def run(self, task: TaskContext) -> None:
        self.started.append((task.id, time.monotonic()))
        self.behaviour(task)


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def account(mysql_server: Engine, mysql_engine: Engine) -> Iterator[str]:
    """The URL of a fresh least-privileged account on the test database."""
    name, database = f"rw_{secrets.token_hex(4)}", mysql_engine.url.database
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"CREATE USER '{name}'@'127.0.0.1' IDENTIFIED BY 'rw'")
        conn.exec_driver_sql(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON `{database}`.* TO '{name}'@'127.0.0.1'"
        )
    yield mysql_engine.url.set(username=name, password="rw").render_as_string(hide_password=False)
    with mysql_server.begin() as conn:
        conn.exec_driver_sql(f"DROP USER '{name}'@'127.0.0.1'")


@pytest.fixture
def read_only(mysql_server: Engine) -> Iterator[Callable[[bool], None]]:
    """``read_only(True)`` makes the server refuse the account's writes; off at teardown."""

    def switch(on: bool) -> None:
        with mysql_server.connect() as conn:
            conn.exec_driver_sql(f"SET GLOBAL read_only = {'ON' if on else 'OFF'}")

    yield switch
    switch(False)


@pytest.fixture
def rt(account: str, probe: Probe) -> Iterator[Runtime]:
    settings = load_settings(
        {
            "BRIDGE_DATABASE_URL": account,
            "BRIDGE_BROKER_URL": "amqp://unused//",
            "BRIDGE_DISPATCH_LEASE": "60",
            "BRIDGE_REPORT_ATTEMPTS": "3",
            "BRIDGE_DISPATCH_AHEAD": "off",  # a poll leases every due row
        }
    )
    runtime = Runtime(settings, PhorgeQueue(make_engine(account), 3), Registry([probe]))
    runtime.writes.interval = 0.05  # try refused writes often: the tests wait on them
    yield runtime
    runtime.queue.session.close()
    runtime.queue.engine.dispose()


def lease(rt: Runtime, count: int = 1, seconds: int = 60) -> list[Task]:
    rt.queue.enqueue_many([NewTask(PROBE)] * count)
    return rt.queue.lease(count, seconds, classes=[PROBE])


def archived(rt: Runtime, task_id: int) -> list[Any]:
    with rt.queue.engine.connect() as conn:
        return conn.execute(select(archive).where(archive.c.id == task_id)).all()


def active_row(rt: Runtime, task_id: int) -> Any:
    with rt.queue.engine.connect() as conn:
        return conn.execute(select(active).where(active.c.id == task_id)).first()


def later(seconds: float, action: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def gate_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage().split(" (")[0].split(",")[0]
        for r in caplog.records
        if r.name == "bridge.engine.writes"
    ]


# -- read-only -------------------------------------------------------------------------------


def test_an_outcome_refused_while_read_only_is_held_and_written_once(rt, probe, read_only, caplog):
    [task] = lease(rt)
    timers: list[threading.Timer] = []

    def turn_read_only(ctx: TaskContext) -> None:
        read_only(True)
        timers.append(later(1.0, lambda: read_only(False)))

    probe.behaviour = turn_read_only
    with caplog.at_level(logging.INFO):
        ran = run_task(rt, task.lease)
    timers[0].join()
    assert ran.outcome is Outcome.SUCCESS, ran
    assert len(probe.started) == 1
    [row] = archived(rt, task.id)
    assert (row.result, row.leaseOwner) == (0, labelled(task.lease_owner, "native"))
    assert active_row(rt, task.id) is None
    # One line when writes start to be refused, one when they are accepted again.
    assert gate_lines(caplog) == [
        "the database refuses writes",
        "the database accepts writes again",
    ]
    assert not [r for r in caplog.records if r.exc_info], "no traceback"
    assert rt.writes.is_open


def test_no_task_of_a_batch_starts_while_writes_are_refused(rt, probe, read_only):
    tasks = lease(rt, 3)
    off_at: list[float] = []
    timers: list[threading.Timer] = []

    def window(ctx: TaskContext) -> None:
        if ctx.id == tasks[0].id:
            read_only(True)
            timers.append(later(1.0, lambda: (read_only(False), off_at.append(time.monotonic()))))

    probe.behaviour = window
    batch = Batch(rt, tasks[0].lease_owner, None)
    rest = batch.run([Leased(t.id, t.failure_count, PROBE) for t in tasks])
    timers[0].join()
    assert rest == []
    assert [ran.outcome for _, ran, _ in batch.reports] == [Outcome.SUCCESS] * 3
    started = dict(probe.started)
    assert started[tasks[1].id] >= off_at[0], "the next task started before writes returned"
    assert all(len(archived(rt, t.id)) == 1 for t in tasks)


def test_a_refusal_longer_than_the_lease_gives_the_outcome_up_and_the_rest_back(
    rt, probe, read_only, caplog
):
    tasks = lease(rt, 3, seconds=2)
    probe.behaviour = lambda ctx: read_only(True)
    batch = Batch(rt, tasks[0].lease_owner, None)
    with caplog.at_level(logging.WARNING):
        rest = batch.run([Leased(t.id, t.failure_count, PROBE) for t in tasks])
    read_only(False)
    # The first task ran; its outcome could not be written within its lease, so the lease
    # will expire and the task run again, as after a crash. The others never started and
    # go back (still leased) for the caller to send on.
    [(item, ran, _)] = batch.reports
    assert (item.id, ran.outcome) == (tasks[0].id, Outcome.UNREPORTED)
    assert READ_ONLY_ERROR in ran.reason
    assert [i.id for i in rest] == [t.id for t in tasks[1:]]
    assert [task_id for task_id, _ in probe.started] == [tasks[0].id]
    row = active_row(rt, tasks[0].id)
    assert (row.leaseOwner, row.failureCount) == (tasks[0].lease_owner, 0)
    assert gate_lines(caplog) == ["the database refuses writes"]


def test_the_poll_leases_nothing_while_writes_are_refused(rt, read_only, caplog):
    ids = rt.queue.enqueue_many([NewTask(PROBE)] * 3)
    sent: list[Leased] = []

    def send(owner: str, tasks: Any, queue: str, size: int, repoll_at: int | None = None) -> int:
        sent.extend(tasks)
        return len(tasks)

    read_only(True)
    with caplog.at_level(logging.INFO):
        assert [poll_once(rt, send) for _ in range(3)] == [0, 0, 0]
        assert {t.lease_owner for t in rt.queue.list()} == {None}
        read_only(False)
        assert poll_once(rt, send) == 3
    assert sorted(t.id for t in sent) == ids
    assert gate_lines(caplog) == [
        "the database refuses writes",
        "the database accepts writes again",
    ]
    assert not [r for r in caplog.records if r.exc_info], "no traceback"


def test_an_idle_poll_reopens_the_gate_once_writes_return(rt, read_only):
    """With nothing to lease, the poll's probe alone tells that writes are back, so an
    idle worker's gauge does not stay at "refused"."""
    rt.queue.enqueue(PROBE)
    read_only(True)
    assert poll_once(rt, lambda *args, **kwargs: 0) == 0
    assert not rt.writes.is_open
    read_only(False)
    with rt.queue.engine.begin() as conn:  # nothing due any more
        conn.execute(active.delete())
    assert poll_once(rt, lambda *args, **kwargs: 0) == 0
    assert rt.writes.is_open


def test_a_message_waits_at_the_gate_and_runs_once_writes_return(rt, probe, read_only):
    """A task dispatched before the window, received while writes are refused, starts
    only once they are accepted again."""
    [task] = lease(rt)
    read_only(True)
    with pytest.raises(Exception, match=READ_ONLY_ERROR) as refused:
        rt.queue.probe_writes()
    rt.writes.refused(refused.value)  # as the poll or another task would have found
    off_at: list[float] = []
    timer = later(0.5, lambda: (read_only(False), off_at.append(time.monotonic())))
    ran = run_task(rt, task.lease)
    timer.join()
    assert ran.outcome is Outcome.SUCCESS
    assert probe.started[0][1] >= off_at[0]


# -- other refusals ---------------------------------------------------------------------------


def test_a_full_table_is_held_like_read_only(rt, probe, monkeypatch, caplog):
    [task] = lease(rt)
    full = MySQLdb.OperationalError(1114, "The table 'worker_archivetask' is full")
    flaky_statement(monkeypatch, sql.ARCHIVE, failures=3, error=lambda: full)
    with caplog.at_level(logging.INFO):
        ran = run_task(rt, task.lease)
    assert ran.outcome is Outcome.SUCCESS
    assert len(archived(rt, task.id)) == 1 and len(probe.started) == 1
    assert gate_lines(caplog) == [
        "the database refuses writes",
        "the database accepts writes again",
    ]


@pytest.mark.parametrize("code", [1205, 1213], ids=["lock-wait-timeout", "deadlock"])
def test_a_lock_conflict_on_the_outcome_is_retried(rt, probe, monkeypatch, code):
    [task] = lease(rt)
    conflict = MySQLdb.OperationalError(code, "lock conflict")
    flaky_statement(monkeypatch, sql.ARCHIVE, failures=1, error=lambda: conflict)
    assert run_task(rt, task.lease).outcome is Outcome.SUCCESS
    assert len(archived(rt, task.id)) == 1


def test_a_real_lock_wait_timeout_on_the_outcome_is_retried(
    account, mysql_server, mysql_engine, probe
):
    """Another session holds the row; the outcome waits, times out (1205), and is tried
    again once the row is free."""
    with mysql_server.connect() as conn:
        conn.exec_driver_sql("SET GLOBAL innodb_lock_wait_timeout = 1")
    try:
        settings = load_settings(
            {"BRIDGE_DATABASE_URL": account, "BRIDGE_BROKER_URL": "amqp://unused//"}
        )
        rt = Runtime(settings, PhorgeQueue(make_engine(account), 5), Registry([probe]))
        [task] = lease(rt)
        holder = mysql_engine.connect()
        locked = holder.begin()
        holder.execute(select(active).where(active.c.id == task.id).with_for_update())
        timer = later(1.5, locked.rollback)
        probe.behaviour = lambda ctx: None
        ran = run_task(rt, task.lease)
        timer.join()
        holder.close()
        assert ran.outcome is Outcome.SUCCESS
        assert len(archived(rt, task.id)) == 1
        rt.queue.session.close()
        rt.queue.engine.dispose()
    finally:
        with mysql_server.connect() as conn:
            conn.exec_driver_sql("SET GLOBAL innodb_lock_wait_timeout = 50")


# -- a connection lost in the middle of an outcome ------------------------------------------

OUTCOMES: dict[str, tuple[Callable[[TaskContext], None], Outcome]] = {
    "success": (lambda ctx: None, Outcome.SUCCESS),
    "permanent-failure": (
        lambda ctx: (_ for _ in ()).throw(PermanentFailure("broken")),
        Outcome.PERMANENT_FAILURE,
    ),
    "failure": (
        lambda ctx: (_ for _ in ()).throw(TemporaryFailure("down", delay=60)),
        Outcome.FAILURE,
    ),
    "yield": (lambda ctx: (_ for _ in ()).throw(Yield(delay=60)), Outcome.YIELD),
}


def kill_after_commit(monkeypatch: pytest.MonkeyPatch, admin: Engine) -> list[int]:
    """The next outcome transaction commits, then its connection is killed before the
    client reads the answer: the client sees a lost connection (2013) and cannot know
    the COMMIT happened. Returns the killed connection ids."""
    original = MySQLdb.cursors.BaseCursor.execute
    killed: list[int] = []

    def execute(self: Any, query: Any, args: Any = None) -> Any:
        result = original(self, query, args)
        if not killed and isinstance(query, str) and query.startswith("START TRANSACTION"):
            while self.nextset():  # every statement has run, the COMMIT included
                pass
            killed.append(self.connection.thread_id())
            with admin.connect() as conn:
                conn.exec_driver_sql(f"KILL CONNECTION {killed[0]}")
            raise MySQLdb.OperationalError(2013, "Lost connection to server during query")
        return result

    monkeypatch.setattr(MySQLdb.cursors.BaseCursor, "execute", execute)
    return killed


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_an_outcome_committed_as_its_connection_died_is_found_and_not_written_again(
    rt, probe, mysql_server, monkeypatch, outcome, caplog
):
    [task] = lease(rt)
    behaviour, expected = OUTCOMES[outcome]
    probe.behaviour = behaviour
    killed = kill_after_commit(monkeypatch, mysql_server)
    ran = run_task(rt, task.lease)
    assert killed, "the outcome's connection was killed"
    assert ran.outcome is expected, ran  # not lease-lost: the row says it was written
    assert "outcome was written before the connection was lost" in caplog.text
    rows, row = archived(rt, task.id), active_row(rt, task.id)
    if expected in (Outcome.SUCCESS, Outcome.PERMANENT_FAILURE):
        assert len(rows) == 1 and row is None
        assert rows[0].result == (0 if expected is Outcome.SUCCESS else 1)
    elif expected is Outcome.FAILURE:
        assert rows == [] and row.failureCount == 1, "one failure counted, not two"
    else:
        assert rows == [] and (row.leaseOwner, row.failureCount) == (YIELD_OWNER, 0)


def test_an_outcome_whose_connection_is_killed_before_commit_is_written_on_retry(
    rt, probe, account, mysql_server, mysql_engine
):
    """A real KILL while the outcome waits for a row lock: the server rolls the
    transaction back, and the retry writes it."""
    [task] = lease(rt)
    user = account.split("://", 1)[1].split(":", 1)[0]
    holder = mysql_engine.connect()
    locked = holder.begin()

    def kill_the_waiting_outcome() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with mysql_server.connect() as conn:
                waiting = (
                    conn.exec_driver_sql(
                        "SELECT ID FROM information_schema.PROCESSLIST "
                        f"WHERE USER = '{user}' AND COMMAND = 'Query'"
                    )
                    .scalars()
                    .all()
                )
                if waiting:
                    conn.exec_driver_sql(f"KILL CONNECTION {waiting[0]}")
                    break
            time.sleep(0.05)
        locked.rollback()

    def lock_the_row(ctx: TaskContext) -> None:
        holder.execute(select(active).where(active.c.id == ctx.id).with_for_update())
        killer.start()

    killer = threading.Thread(target=kill_the_waiting_outcome)
    probe.behaviour = lock_the_row
    ran = run_task(rt, task.lease)
    killer.join()
    holder.close()
    assert ran.outcome is Outcome.SUCCESS, ran
    assert len(archived(rt, task.id)) == 1


def test_doctor_says_the_database_refuses_writes(account, read_only, amqp_url, monkeypatch):
    for name in [n for n in os.environ if n.startswith("BRIDGE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("BRIDGE_DATABASE_URL", account)
    monkeypatch.setenv("BRIDGE_BROKER_URL", amqp_url)

    def doctor() -> tuple[int, dict[str, Any]]:
        result = CliRunner().invoke(main, ["doctor", "--json"], catch_exceptions=False)
        return result.exit_code, {c["name"]: c for c in json.loads(result.output)["checks"]}

    code, checks = doctor()
    assert checks["database writes"] == {
        "name": "database writes",
        "status": "ok",
        "detail": "accepted",
    }
    read_only(True)
    code, checks = doctor()
    assert code == 1
    assert checks["database writes"]["status"] == "fail"
    assert "read-only or full" in checks["database writes"]["detail"]
    assert READ_ONLY_ERROR in checks["database writes"]["detail"]


def test_a_success_with_follow_ups_committed_as_its_connection_died_is_found(
    rt, probe, mysql_server, monkeypatch
):
    """The follow-ups' transaction (through SQLAlchemy) commits, then its connection is
    killed before the client hears: the retry finds the fence gone, the row says it was
    this outcome, and the follow-up exists once."""
    [task] = lease(rt)
    probe.behaviour = lambda ctx: ctx.queue_task("FollowUpWorker", {"n": 1})
    original = MySQLdb.connections.Connection.commit
    killed: list[int] = []

    def commit(self: Any) -> None:
        original(self)
        if not killed:
            killed.append(self.thread_id())
            with mysql_server.connect() as conn:
                conn.exec_driver_sql(f"KILL CONNECTION {killed[0]}")
            raise MySQLdb.OperationalError(2013, "Lost connection to server during query")

    monkeypatch.setattr(MySQLdb.connections.Connection, "commit", commit)
    ran = run_task(rt, task.lease)
    assert killed
    assert ran.outcome is Outcome.SUCCESS, ran
    assert len(archived(rt, task.id)) == 1
    assert [t.task_class for t in rt.queue.list(TaskFilter(active=True))] == ["FollowUpWorker"]
