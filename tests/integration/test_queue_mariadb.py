"""On MariaDB, what only a real server shows: PHP writing beside the bridge, concurrent
leasers, Phorge's strict mode, the server's clock and the raw rows PHP will read.

PHP is played by a raw MySQLdb connection running Phorge's own statements.
"""

from __future__ import annotations

import json
import time
from contextlib import closing

import MySQLdb
import MySQLdb.cursors
import outcomes
import pytest
from services import url_of
from sqlalchemy import Engine, event, func, select, update
from sqlalchemy.exc import DataError
from threads import run_together

from bridge.queue import OperatorActions, PhorgeQueue, make_engine
from bridge.queue.dialect import db_now
from bridge.queue.model import NewTask, State, TaskFilter, lease_epoch
from bridge.queue.schema import lisk_counter
from bridge.queue.schema import worker_activetask as active

pytestmark = pytest.mark.mariadb

WORKER = "PhabricatorTestWorker"
BIG_KEY = 7713765376809813936

# LiskDAO's IDS_COUNTER statement, verbatim.
PHP_NEXT_ID = (
    "INSERT INTO lisk_counter (counterName, counterValue)"
    " VALUES ('worker_activetask', LAST_INSERT_ID(1))"
    " ON DUPLICATE KEY UPDATE counterValue = LAST_INSERT_ID(counterValue + 1)"
)
PHP_INSERT_TASK = (
    "INSERT INTO worker_activetask (id, taskClass, leaseOwner, leaseExpires, failureCount,"
    " dataID, failureTime, priority, objectPHID, containerPHID, dateCreated, dateModified)"
    " VALUES (%s, %s, NULL, NULL, 0, %s, NULL, 2000, NULL, NULL, %s, %s)"
)


@pytest.fixture
def q(mysql_queue: PhorgeQueue) -> PhorgeQueue:
    return mysql_queue


def connect_raw(engine: Engine) -> MySQLdb.Connection:
    """A connection of its own, autocommitting like PHP's."""
    url = engine.url
    return MySQLdb.connect(
        host=url.host,
        port=url.port or 3306,
        user=url.username,
        password=url.password or "",
        database=url.database,
        charset="utf8mb4",
        autocommit=True,
    )


def raw_rows(engine: Engine, query: str) -> list[dict]:
    """Rows as PHP's plain SELECT sees them, column types and all."""
    with closing(connect_raw(engine)) as conn:
        cursor = conn.cursor(MySQLdb.cursors.DictCursor)
        cursor.execute(query)
        return list(cursor.fetchall())


def php_schedule_task(conn: MySQLdb.Connection, task_class: str, data) -> int:
    """``PhabricatorWorker::scheduleTask`` as PHP runs it: three autocommitted statements."""
    cursor = conn.cursor()
    cursor.execute(
        "INSERT INTO worker_taskdata (data) VALUES (%s)",
        (json.dumps(data, separators=(",", ":")),),
    )
    data_id = cursor.lastrowid
    cursor.execute(PHP_NEXT_ID)
    cursor.execute("SELECT LAST_INSERT_ID()")
    (task_id,) = cursor.fetchone()
    epoch = int(time.time())
    cursor.execute(PHP_INSERT_TASK, (task_id, task_class, data_id, epoch, epoch))
    return task_id


def test_ids_interleave_with_a_php_writer_on_another_connection(q):
    per_writer = 60

    def php(name):
        with closing(connect_raw(q.engine)) as conn:
            payloads = [{"by": name, "n": n} for n in range(per_writer)]
            return [(php_schedule_task(conn, "PhpWorker", p), p) for p in payloads]

    def bridge_one_by_one(name):
        payloads = [{"by": name, "n": n} for n in range(per_writer)]
        return [(q.enqueue("BridgeWorker", p), p) for p in payloads]

    def bridge_in_batches(name):
        written = []
        for start in range(0, per_writer, 5):
            batch = [NewTask("BridgeWorker", {"by": name, "n": n}) for n in range(start, start + 5)]
            written += zip(q.enqueue_many(batch), [t.data for t in batch], strict=True)
        return written

    results = run_together(
        lambda: php("php-1"),
        lambda: php("php-2"),
        lambda: bridge_one_by_one("bridge-1"),
        lambda: bridge_in_batches("bridge-2"),
    )

    written = [pair for result in results for pair in result]
    ids = [task_id for task_id, _ in written]
    with q.engine.connect() as conn:
        last = conn.execute(select(lisk_counter.c.counterValue)).scalar_one()
    assert len(set(ids)) == len(ids) == 4 * per_writer  # no collision
    assert sorted(ids) == list(range(1, last + 1))  # one sequence: no id lost or skipped
    # Each row holds its own writer's payload, and the bridge reads PHP's rows.
    leased = q.lease(len(ids), owner_prefix="test")
    assert {t.id: t.data for t in leased} == dict(written)


def test_eight_concurrent_leasers_never_win_the_same_row(q):
    ids = q.enqueue_many([NewTask(WORKER, {"n": n}) for n in range(2000)])
    # Every fifth row was leased by a worker that died: phase 2 is contended as well.
    with q.engine.begin() as conn:
        conn.execute(
            update(active)
            .where(active.c.id.in_(ids[::5]))
            .values(leaseOwner="dead:1", leaseExpires=db_now() - active.c.id)
        )

    def leasable() -> int:
        with q.engine.connect() as conn:
            free = (active.c.leaseOwner.is_(None)) | (active.c.leaseOwner == "dead:1")
            return conn.execute(select(func.count()).where(free)).scalar_one()

    call_owners: list[str] = []  # one entry a call that won rows

    def leaser() -> list[tuple[int, str]]:
        won = []
        while True:
            tasks = q.lease(25, 600, owner_prefix="leaser")
            if tasks:
                owner = tasks[0].lease_owner
                assert owner.startswith("leaser:")
                assert all(t.lease_owner == owner for t in tasks)
                call_owners.append(owner)
                won += [(t.id, owner) for t in tasks]
            if not tasks and leasable() == 0:
                return won

    leases = [pair for result in run_together(*[leaser] * 8) for pair in result]
    assert len(set(call_owners)) == len(call_owners)  # each call leased under its own owner

    leased_ids = [task_id for task_id, _ in leases]
    assert len(leased_ids) == len(set(leased_ids))  # never the same row twice
    assert sorted(leased_ids) == ids  # together, every row
    with q.engine.connect() as conn:
        owners = dict(conn.execute(select(active.c.id, active.c.leaseOwner)).all())
    assert owners == dict(leases)  # each row belongs to the call that won it


def test_sessions_run_in_phorges_strict_mode(q):
    with q.engine.connect() as conn:
        modes = conn.exec_driver_sql("SELECT @@SESSION.sql_mode").scalar_one().split(",")
        assert "STRICT_ALL_TABLES" in modes
        # Strict: a value that does not fit is refused, never silently truncated.
        with pytest.raises(DataError):
            conn.exec_driver_sql(
                "INSERT INTO lisk_counter (counterName, counterValue) VALUES (%s, 1)", ("x" * 33,)
            )


def test_rows_we_write_are_plain_phorge_rows(q):
    phids = {"object_phid": "PHID-TASK-abc", "container_phid": "PHID-REPO-def"}
    waiting = q.enqueue(WORKER, {"key": BIG_KEY}, priority=1500, **phids)
    done = q.enqueue(WORKER, 2, priority=1500, **phids)
    first, second = q.lease(2, owner_prefix="test")
    assert outcomes.fail_temporary(q, waiting, first.lease_owner, 300)
    assert outcomes.complete(q, done, second.lease_owner, 1_500_000)

    [active_row] = raw_rows(q.engine, "SELECT * FROM worker_activetask")
    [archive_row] = raw_rows(q.engine, "SELECT * FROM worker_archivetask")
    data = raw_rows(q.engine, "SELECT id, data FROM worker_taskdata ORDER BY id")

    common = {
        "id": int,
        "taskClass": str,
        "leaseOwner": str,
        "leaseExpires": int,
        "failureCount": int,
        "dataID": int,
        "priority": int,
        "objectPHID": bytes,
        "containerPHID": bytes,
        "dateCreated": int,
        "dateModified": int,
    }
    assert {k: type(v) for k, v in active_row.items()} == {**common, "failureTime": int}
    archived_types = {**common, "result": int, "duration": int, "archivedEpoch": int}
    assert {k: type(v) for k, v in archive_row.items()} == archived_types
    assert (active_row["objectPHID"], active_row["containerPHID"]) == (
        b"PHID-TASK-abc",
        b"PHID-REPO-def",
    )
    assert (active_row["failureCount"], active_row["priority"]) == (1, 1500)
    assert (archive_row["result"], archive_row["duration"]) == (0, 1_500_000)
    assert archive_row["objectPHID"] == b"PHID-TASK-abc"
    # What PHP's json_decode($data, true) reads back, big integer included.
    assert [(row["data"], json.loads(row["data"])) for row in data] == [
        ('{"key":7713765376809813936}', {"key": BIG_KEY}),
        ("2", 2),
    ]
    # PHP selects by PHID with a plain string.
    found = raw_rows(
        q.engine, "SELECT id FROM worker_activetask WHERE objectPHID = 'PHID-TASK-abc'"
    )
    assert found == [{"id": waiting}]


def test_times_come_from_the_database_clock_never_the_hosts(mysql_engine):
    skew = 10 * 86400  # the server's clock is ten days behind this host's
    engine = make_engine(url_of(mysql_engine))

    @event.listens_for(engine, "connect")
    def server_clock_behind(dbapi_connection, _record):
        cursor = dbapi_connection.cursor()
        cursor.execute("SET SESSION timestamp = UNIX_TIMESTAMP() - %s", (skew,))
        cursor.close()

    q = PhorgeQueue(engine)
    try:
        server_now = q.server_time()
        assert abs(server_now + skew - time.time()) < 5

        retried, yielded, done, cancelled = (q.enqueue(WORKER, {"n": n}) for n in range(4))
        tasks = {t.id: t for t in q.lease(3, owner_prefix="test")}
        # The owners the lease minted carry the database's time, not the host's.
        assert all(
            server_now <= lease_epoch(t.lease_owner) <= server_now + 5 for t in tasks.values()
        )
        assert OperatorActions(q).cancel(TaskFilter(ids=[cancelled]))[0].done
        assert outcomes.fail_temporary(q, retried, tasks[retried].lease_owner, 0)
        with engine.begin() as conn:
            conn.execute(
                update(active).where(active.c.id == retried).values(leaseExpires=db_now() - 1)
            )
        [again] = q.lease(1, owner_prefix="test")
        assert outcomes.renew(q, retried, again.lease_owner, 600)
        assert outcomes.yield_(q, yielded, tasks[yielded].lease_owner, 60)
        assert outcomes.complete(q, done, tasks[done].lease_owner, 5, [NewTask(WORKER, {})])
        assert OperatorActions(q).retry(TaskFilter(ids=[cancelled]))[0].done

        # By the host's clock this yield ended ten days ago and the archive row is old.
        assert q.get(yielded).state is State.YIELDED
        stats = q.stats()
        assert stats.by_class[WORKER]["yielded"] == 1
        assert stats.by_class[WORKER]["archived-succeeded"] == 1
        assert 0 <= stats.oldest_queued_age <= 60
        epochs = [
            value
            for table in ("worker_activetask", "worker_archivetask")
            for row in raw_rows(engine, f"SELECT * FROM {table}")
            for column, value in row.items()
            if column
            in ("leaseExpires", "failureTime", "dateCreated", "dateModified", "archivedEpoch")
        ]
        epochs = [value for value in epochs if value]  # NULL, and retry's leaseExpires 0
        assert len(epochs) >= 15
        assert all(server_now - 60 <= value <= server_now + 7260 for value in epochs), epochs
    finally:
        engine.dispose()
