"""Phorge's worker tables as the bench drives them, in plain SQL on its own autocommit
connection, whose *session* status it subtracts from the *global* one: the consumers'."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import MySQLdb

DATABASE = "phabricator_worker"
TASK_CLASS = "PhabricatorTestWorker"
TABLES = ("worker_activetask", "worker_archivetask", "worker_taskdata", "lisk_counter")
STATUS = ("Questions", "Com_commit")
GLOBAL_ONLY = ("Innodb_log_writes",)  # each a durable flush, for a group of commits
IDS = "id BETWEEN %s AND %s"  # a batch's rows
Status = tuple[dict[str, int], dict[str, int]]  # global, session
# LiskDAO::loadNextCounterValue, with +n for a batch of ids in one statement.
NEXT_IDS = (
    "INSERT INTO lisk_counter (counterName, counterValue)"
    " VALUES ('worker_activetask', LAST_INSERT_ID(%s))"
    " ON DUPLICATE KEY UPDATE counterValue = LAST_INSERT_ID(counterValue + %s)"
)
INSERT_ACTIVE = (
    "INSERT INTO worker_activetask (id, taskClass, leaseOwner, leaseExpires, failureCount, dataID,"
    " failureTime, priority, objectPHID, containerPHID, dateCreated, dateModified)"
    " VALUES (%s, %s, NULL, NULL, 0, %s, NULL, %s, NULL, NULL, %s, %s)"  # priority 2000: default
)


@dataclass(frozen=True)
class Batch:
    """Tasks enqueued in one transaction: ids ``first..last``."""

    first: int
    last: int
    committed: float  # time.time() right after COMMIT returned

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def ids(self) -> range:
        return range(self.first, self.last + 1)


def create_tables(conn: MySQLdb.Connection, ddl: Path) -> None:
    """(Re)create the four queue tables from the reference DDL (phd's copy made them too)."""
    cur = conn.cursor()
    charset = "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
    cur.execute(f"CREATE DATABASE IF NOT EXISTS {DATABASE} {charset}")
    cur.execute(f"USE {DATABASE}")
    cur.execute(f"DROP TABLE IF EXISTS {', '.join(TABLES)}")
    lines = ddl.read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("--"))
    for statement in filter(str.strip, text.split(";")):
        cur.execute(statement)


CONFIG = "phabricator_config.config_entry"  # beside phabricator_worker, as in Phorge


def set_canary(conn: MySQLdb.Connection, ddl: Path, weights: dict[str, object] | None) -> None:
    """Phorge's config table with the canary's weights (``phorge-bridge.canary``),
    or without them."""
    cur = conn.cursor()
    cur.execute("CREATE DATABASE IF NOT EXISTS phabricator_config")
    cur.execute(f"DROP TABLE IF EXISTS {CONFIG}")
    table = ddl.read_text().split("CREATE TABLE `config_entry`", 1)[1].split(";")[0]
    cur.execute(f"CREATE TABLE {CONFIG} {table}")
    if weights:
        cur.execute(
            f"INSERT INTO {CONFIG} (phid, namespace, configKey, value, isDeleted, dateCreated,"
            " dateModified) VALUES ('PHID-CONF-benchkitbenchkitbenc', 'default',"
            " 'phorge-bridge.canary', %s, 0, UNIX_TIMESTAMP(), UNIX_TIMESTAMP())",
            (json.dumps(weights),),
        )


def truncate(conn: MySQLdb.Connection) -> None:
    """Empty the queue between scenarios; ``lisk_counter`` keeps growing, as in Phorge."""
    for table in TABLES[:3]:
        conn.cursor().execute(f"TRUNCATE TABLE {table}")


def enqueue(
    conn: MySQLdb.Connection, count: int, data: str | Sequence[str], task_class: str = TASK_CLASS
) -> Batch:
    """``count`` tasks in ONE transaction, as ``PhabricatorWorker::scheduleTask`` writes
    them; ``data``: every task's, or a sequence the tasks take in turn."""
    datas = [data] if isinstance(data, str) else list(data)
    now = int(time.time())
    cur = conn.cursor()
    cur.execute("START TRANSACTION")
    try:
        cur.execute(NEXT_IDS, (count, count))
        cur.execute("SELECT LAST_INSERT_ID()")
        last = int(cur.fetchone()[0])
        datas = [(datas[n % len(datas)],) for n in range(count)]
        cur.executemany("INSERT INTO worker_taskdata (data) VALUES (%s)", datas)
        # The bench is the only writer of data rows: ours are the newest ``count``.
        cur.execute("SELECT id FROM worker_taskdata ORDER BY id DESC LIMIT %s", (count,))
        data_ids = sorted(int(row[0]) for row in cur.fetchall())
        ids = range(last - count + 1, last + 1)
        rows = [(i, task_class, d, 2000, now, now) for i, d in zip(ids, data_ids, strict=True)]
        cur.executemany(INSERT_ACTIVE, rows)
        cur.execute("COMMIT")
    except BaseException:
        cur.execute("ROLLBACK")
        raise
    return Batch(ids.start, last, time.time())


def progress(conn: MySQLdb.Connection, batch: Batch) -> tuple[int, int, int]:
    """(active, leased, archived) rows of the batch, on its id range only."""
    cur = conn.cursor()
    cur.execute(
        f"SELECT (SELECT COUNT(*) FROM worker_activetask WHERE {IDS}),"
        f" (SELECT COUNT(*) FROM worker_activetask WHERE {IDS} AND leaseOwner IS NOT NULL),"
        f" (SELECT COUNT(*) FROM worker_archivetask WHERE {IDS})",
        (batch.first, batch.last) * 3,
    )
    active, leased, archived = (int(v) for v in cur.fetchone())
    return active, leased, archived


def failed(conn: MySQLdb.Connection, batch: Batch) -> int:
    """The batch's archived rows with a result other than 0 (each task is there once: the
    archive's key forbids more)."""
    cur = conn.cursor()
    sql = f"SELECT COUNT(*) FROM worker_archivetask WHERE {IDS} AND result != 0"
    cur.execute(sql, (batch.first, batch.last))
    return int(cur.fetchone()[0])


def status(conn: MySQLdb.Connection) -> Status:
    """The global status counters, then this connection's session ones."""
    found = []
    for scope, names in (("GLOBAL", STATUS + GLOBAL_ONLY), ("SESSION", STATUS)):
        cur = conn.cursor()
        cur.execute(f"SHOW {scope} STATUS WHERE Variable_name IN ({', '.join(map(repr, names))})")
        found.append({name: int(value) for name, value in cur.fetchall()})
    return found[0], found[1]


def others_since(before: Status, after: Status, offset: dict[str, int]) -> dict[str, int]:
    """What clients other than the bench's connection did between two ``status`` reads,
    less ``offset`` (what the reads themselves leave: ``others_since`` of two at once)."""
    (g0, s0), (g1, s1) = before, after
    found = {n: g1[n] - g0[n] - (s1[n] - s0[n]) - offset.get(n, 0) for n in STATUS}
    return found | {n: g1[n] - g0[n] for n in GLOBAL_ONLY}
