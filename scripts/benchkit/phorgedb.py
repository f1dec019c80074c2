"""Phorge's worker database as the bench drives it: tables, enqueue, progress, checks.

All of it is plain SQL on one MySQLdb connection (autocommit on), the bench's own, kept
for the whole run: the server's *session* status of that connection is what the bench
subtracts from the *global* status to count only the consumers' requests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import MySQLdb

DATABASE = "phabricator_worker"  # Phorge's default namespace
TASK_CLASS = "PhabricatorTestWorker"
PRIORITY_DEFAULT = 2000
WORKER_TABLES = ("worker_activetask", "worker_archivetask", "worker_taskdata", "lisk_counter")
STATUS_NAMES = ("Questions", "Com_commit")
# Writes of the redo log, each flushed to disk with durable commits: one per group of
# commits that wrote. Global only, and the bench's own reads never write it.
GLOBAL_ONLY_NAMES = ("Innodb_log_writes",)

# LiskDAO::loadNextCounterValue, with +n instead of +1 so that one statement takes a batch.
NEXT_IDS = (
    "INSERT INTO lisk_counter (counterName, counterValue)"
    " VALUES ('worker_activetask', LAST_INSERT_ID(%s))"
    " ON DUPLICATE KEY UPDATE counterValue = LAST_INSERT_ID(counterValue + %s)"
)
INSERT_DATA = "INSERT INTO worker_taskdata (data) VALUES (%s)"
INSERT_ACTIVE = (
    "INSERT INTO worker_activetask (id, taskClass, leaseOwner, leaseExpires, failureCount,"
    " dataID, failureTime, priority, objectPHID, containerPHID, dateCreated, dateModified)"
    " VALUES (%s, %s, NULL, NULL, 0, %s, NULL, %s, NULL, NULL, %s, %s)"
)


@dataclass(frozen=True)
class Batch:
    """Tasks enqueued in one transaction: ids ``first..last``, committed at ``committed``."""

    first: int
    last: int
    committed: float  # time.time() right after COMMIT returned

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def ids(self) -> range:
        return range(self.first, self.last + 1)


def reference_ddl(path: Path) -> list[str]:
    """The CREATE TABLE statements of the reference schema file (comments dropped)."""
    text = "\n".join(
        line for line in path.read_text().splitlines() if not line.lstrip().startswith("--")
    )
    return [statement.strip() for statement in text.split(";") if statement.strip()]


def create_worker_tables(conn: MySQLdb.Connection, ddl: Path) -> None:
    """(Re)create Phorge's four queue tables in ``phabricator_worker`` from the reference DDL.

    Only these four are dropped first: when phd runs, ``bin/storage upgrade`` made the
    same tables (and others) already, from the same DDL.
    """
    cur = conn.cursor()
    cur.execute(
        f"CREATE DATABASE IF NOT EXISTS {DATABASE} CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
    )
    cur.execute(f"USE {DATABASE}")
    for table in WORKER_TABLES:
        cur.execute(f"DROP TABLE IF EXISTS {table}")
    for statement in reference_ddl(ddl):
        cur.execute(statement)


def truncate(conn: MySQLdb.Connection) -> None:
    """Empty the queue between scenarios; ``lisk_counter`` keeps growing, as in Phorge."""
    cur = conn.cursor()
    for table in ("worker_activetask", "worker_archivetask", "worker_taskdata"):
        cur.execute(f"TRUNCATE TABLE {table}")


@contextmanager
def transaction(conn: MySQLdb.Connection) -> Iterator[MySQLdb.cursors.Cursor]:
    """A cursor inside START TRANSACTION ... COMMIT, rolled back on any error."""
    cur = conn.cursor()
    cur.execute("START TRANSACTION")
    try:
        yield cur
        cur.execute("COMMIT")
    except BaseException:
        cur.execute("ROLLBACK")
        raise


def next_ids(cur: MySQLdb.cursors.Cursor, count: int) -> range:
    """``count`` new task ids from lisk_counter, as Phorge takes them (one statement)."""
    cur.execute(NEXT_IDS, (count, count))
    cur.execute("SELECT LAST_INSERT_ID()")
    last = int(cur.fetchone()[0])
    return range(last - count + 1, last + 1)


def enqueue(
    conn: MySQLdb.Connection,
    count: int,
    data_json: str | Sequence[str],
    priority: int = PRIORITY_DEFAULT,
    task_class: str = TASK_CLASS,
) -> Batch:
    """Queue ``count`` tasks (PhabricatorTestWorker unless told) in ONE transaction, ids
    from lisk_counter.

    Rows are those ``PhabricatorWorker::scheduleTask`` writes (owner and expiry NULL,
    priority 2000 unless told, dates now); only the batching differs, so that every task
    is due at the same instant and the clock starts at the commit. ``data_json`` is every
    task's data, or a sequence of data the tasks take in turn (task ``n`` the ``n % len``th:
    search tasks spread over several documents).
    """
    now = int(time.time())
    datas = [data_json] if isinstance(data_json, str) else list(data_json)
    with transaction(conn) as cur:
        ids = next_ids(cur, count)
        cur.executemany(INSERT_DATA, [(datas[n % len(datas)],) for n in range(count)])
        # The bench is the only writer of data rows: ours are the newest ``count``.
        cur.execute("SELECT id FROM worker_taskdata ORDER BY id DESC LIMIT %s", (count,))
        data_ids = sorted(int(row[0]) for row in cur.fetchall())
        rows = [
            (task_id, task_class, data_id, priority, now, now)
            for task_id, data_id in zip(ids, data_ids, strict=True)
        ]
        cur.executemany(INSERT_ACTIVE, rows)
    return Batch(ids.start, ids.stop - 1, time.time())


def load(
    conn: MySQLdb.Connection, count: int, task_class: str, data_json: str, priority: int
) -> None:
    """Queue ``count`` rows of ``task_class`` in seconds, not minutes: INSERT ... SELECT from
    MariaDB's sequence table, data rows first (consecutive ids, the server's lock mode 1),
    ids from lisk_counter; then ANALYZE, so the lease statements see the table as it is."""
    now = int(time.time())
    with transaction(conn) as cur:
        ids = next_ids(cur, count)
        cur.execute(
            f"INSERT INTO worker_taskdata (data) SELECT %s FROM seq_1_to_{count}", (data_json,)
        )
        cur.execute("SELECT LAST_INSERT_ID()")
        data_before = int(cur.fetchone()[0]) - 1
        cur.execute(
            "INSERT INTO worker_activetask (id, taskClass, leaseOwner, leaseExpires,"
            " failureCount, dataID, failureTime, priority, objectPHID, containerPHID,"
            " dateCreated, dateModified)"
            " SELECT %s + seq, %s, NULL, NULL, 0, %s + seq, NULL, %s, NULL, NULL, %s, %s"
            f" FROM seq_1_to_{count}",
            (ids.start - 1, task_class, data_before, priority, now, now),
        )
    conn.cursor().execute("ANALYZE TABLE worker_activetask, worker_taskdata")


def mean_duration(conn: MySQLdb.Connection, batch: Batch) -> float | None:
    """The mean ``duration`` (seconds) the batch's archive rows hold: the worker's own run
    as each consumer measured it (phd, the bridge's PHP runner and Conduit: PHP's)."""
    cur = conn.cursor()
    cur.execute(
        "SELECT AVG(duration) FROM worker_archivetask WHERE id BETWEEN %s AND %s",
        (batch.first, batch.last),
    )
    value = cur.fetchone()[0]
    return None if value is None else float(value) / 1_000_000


def archived_durations(conn: MySQLdb.Connection, ids: list[int]) -> dict[int, int]:
    """Which of ``ids`` are archived, with each run's ``duration`` (µs): one PK lookup."""
    if not ids:
        return {}
    cur = conn.cursor()
    marks = ", ".join(["%s"] * len(ids))
    cur.execute(f"SELECT id, duration FROM worker_archivetask WHERE id IN ({marks})", ids)
    return {int(task_id): int(duration or 0) for task_id, duration in cur.fetchall()}


@dataclass(frozen=True)
class Progress:
    active: int  # rows of the batch in the active table
    leased: int  # of which have an owner
    archived: int  # rows of the batch in the archive

    def done(self, batch: Batch) -> bool:
        return self.active == 0 and self.archived == batch.size

    def started(self) -> bool:
        return self.leased > 0 or self.archived > 0


def progress(conn: MySQLdb.Connection, batch: Batch) -> Progress:
    """Where the batch stands, in one statement on its id range only: rows queued ahead
    of it (the unserved scenario's 300,000) are neither counted nor scanned."""
    cur = conn.cursor()
    cur.execute(
        "SELECT (SELECT COUNT(*) FROM worker_activetask WHERE id BETWEEN %s AND %s),"
        " (SELECT COUNT(*) FROM worker_activetask WHERE id BETWEEN %s AND %s"
        " AND leaseOwner IS NOT NULL),"
        " (SELECT COUNT(*) FROM worker_archivetask WHERE id BETWEEN %s AND %s)",
        (batch.first, batch.last) * 3,
    )
    return Progress(*(int(v) for v in cur.fetchone()))


def check_archived(conn: MySQLdb.Connection, batch: Batch) -> list[str]:
    """Problems with the batch's outcome: every task archived once, with result 0."""
    cur = conn.cursor()
    cur.execute(
        "SELECT COUNT(*), COALESCE(SUM(result = 0), 0) FROM worker_archivetask"
        " WHERE id BETWEEN %s AND %s",
        (batch.first, batch.last),
    )
    archived, succeeded = (int(v) for v in cur.fetchone())
    cur.execute(
        "SELECT COUNT(*) FROM worker_activetask WHERE id BETWEEN %s AND %s",
        (batch.first, batch.last),
    )
    active = int(cur.fetchone()[0])
    problems = []
    if archived != batch.size:  # the archive's primary key makes "more than once" impossible
        problems.append(f"{archived} of {batch.size} tasks archived")
    if succeeded != archived:
        problems.append(f"{archived - succeeded} archived with a result other than 0")
    if active:
        problems.append(f"{active} still in the active table")
    return problems


def status(conn: MySQLdb.Connection, scope: str) -> dict[str, int]:
    """Some of the server's GLOBAL or SESSION status counters."""
    cur = conn.cursor()
    wanted = STATUS_NAMES + (GLOBAL_ONLY_NAMES if scope == "GLOBAL" else ())
    names = ", ".join(f"'{name}'" for name in wanted)
    cur.execute(f"SHOW {scope} STATUS WHERE Variable_name IN ({names})")
    return {name: int(value) for name, value in cur.fetchall()}


@dataclass(frozen=True)
class ServerSample:
    """Global status, then this connection's session status, read one after the other."""

    global_: dict[str, int]
    session: dict[str, int]

    @classmethod
    def take(cls, conn: MySQLdb.Connection) -> ServerSample:
        return cls(status(conn, "GLOBAL"), status(conn, "SESSION"))

    def others_since(self, before: ServerSample, offset: dict[str, int]) -> dict[str, int]:
        """What clients other than this connection did between the two samples."""
        others = {
            name: (self.global_[name] - before.global_[name])
            - (self.session[name] - before.session[name])
            - offset.get(name, 0)
            for name in STATUS_NAMES
        }
        for name in GLOBAL_ONLY_NAMES:
            others[name] = self.global_[name] - before.global_[name]
        return others


def calibrate(conn: MySQLdb.Connection) -> dict[str, int]:
    """The constant left by the sampling itself, read while nothing else is connected."""
    before = ServerSample.take(conn)
    after = ServerSample.take(conn)
    return after.others_since(before, {})
