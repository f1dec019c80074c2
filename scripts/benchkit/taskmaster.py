"""A reference taskmaster: Phorge's PHP taskmaster loop (07c1a51310), statement for
statement, in Python, so every ratio has a baseline on the same database without PHP.

    python3 -m benchkit.taskmaster --port 3309 --user U --password P --database D \
        --records DIR --ready FILE

Followed: ``PhabricatorTaskmasterDaemon::run()`` (lease ONE task, run it, ``sleep(1)`` when
idle), ``PhabricatorWorkerLeaseQuery`` (phases "unleased" then "expired": SELECT, UPDATE
on the same condition, then the joined read), ``executeTask()`` (``checkLease()`` from the
server time, ``archiveTask()`` in one transaction), ``PhabricatorTestWorker`` (a sleep).
One autocommit connection, text statements as ``qsprintf``. Left out: the overseer, PHP
(compare round trips and commits, not CPU) and every path but success. SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import MySQLdb

from benchkit.records import RecordWriter, Spans

DEFAULT_LEASE = 2 * 60 * 60  # PhabricatorWorkerLeaseQuery::getDefaultLeaseDuration
IDLE_SLEEP = 1  # PhabricatorTaskmasterDaemon: "When there's no work, sleep for one second."
RESULT_SUCCESS = 0

PHASES = {
    # phase: (WHERE of the SELECT, ORDER BY)  -- buildCustomWhereClause, buildOrderClause
    "unleased": ("WHERE leaseOwner IS NULL", "ORDER BY priority ASC, id ASC"),
    "expired": ("WHERE leaseExpires < UNIX_TIMESTAMP()", "ORDER BY leaseExpires ASC"),
}
ARCHIVE_COLUMNS = ("id", "taskClass", "leaseOwner", "leaseExpires", "failureCount", "dataID",
                   "priority", "objectPHID", "containerPHID", "result", "duration",
                   "archivedEpoch", "dateCreated", "dateModified")  # fmt: skip


@dataclass
class Task:
    row: dict[str, Any]
    data: Any
    server_time: int
    local_time: int  # time() when the row was read: setServerTime()

    @property
    def id(self) -> int:
        return int(self.row["id"])


@dataclass
class Connection:
    """The one MySQLdb connection, one statement a query as ``queryfx``."""

    conn: MySQLdb.Connection

    def query(self, sql: str, args: Any = None) -> tuple[list[dict[str, Any]], int]:
        """(rows, affected rows) of one statement."""
        cur = self.conn.cursor(MySQLdb.cursors.DictCursor)
        affected = cur.execute(sql, args)
        rows = list(cur.fetchall()) if cur.description else []
        cur.close()
        return rows, int(affected)


def lease_owner_name(sequence: count) -> str:
    """``getLeaseOwnershipName()``: pid:time:host:sequence, the host cut to 32 bytes."""
    host = socket.gethostname()
    if len(host.encode()) > 32:
        host = host.encode()[:29].decode(errors="ignore") + "..."
    return f"{os.getpid()}:{int(time.time())}:{host}:{next(sequence)}"


def lease_one(db: Connection, owner: str) -> Task | None:
    """``PhabricatorWorkerLeaseQuery->setLimit(1)->execute()``: each phase until one leases."""
    for phase, (where, order) in PHASES.items():
        select = f"SELECT id, leaseOwner FROM `worker_activetask` {where} {order} LIMIT 1"
        rows, _ = db.query(select)
        if not rows:
            continue
        row = rows[0]
        if phase == "unleased":
            condition, keys = f"WHERE leaseOwner IS NULL AND id IN ({int(row['id'])})", ()
        else:
            condition, keys = "WHERE (id = %s AND leaseOwner = %s)", (row["id"], row["leaseOwner"])
        _, affected = db.query(
            "UPDATE `worker_activetask` task"
            f" SET leaseOwner = %s, leaseExpires = UNIX_TIMESTAMP() + %s {condition}",
            (owner, DEFAULT_LEASE, *keys),
        )
        if affected:
            break
    else:
        return None
    rows, _ = db.query(
        "SELECT task.*, taskdata.data _taskData, UNIX_TIMESTAMP() _serverTime"
        " FROM `worker_activetask` task LEFT JOIN `worker_taskdata` taskdata"
        " ON taskdata.id = task.dataID WHERE task.leaseOwner = %s"
        f" AND leaseExpires > UNIX_TIMESTAMP() {order} LIMIT 1",
        (owner,),
    )
    if not rows:
        return None
    row = rows[0]
    raw = row.pop("_taskData")
    data = json.loads(raw) if raw else None
    return Task(row, data, int(row.pop("_serverTime")), int(time.time()))


def check_lease(task: Task) -> None:
    """``checkLease()``: judged locally from the server time read at lease."""
    owner = task.row["leaseOwner"]
    if not owner or owner == "(yield)":
        return
    now = task.server_time + (int(time.time()) - task.local_time)
    if now >= int(task.row["leaseExpires"]):
        raise RuntimeError(f"Trying to update Task {task.id} after lease expiration!")


def do_work(task: Task) -> None:
    """``PhabricatorTestWorker::doWork()``: sleep for the task's ``duration``, if any."""
    duration = task.data.get("duration") if isinstance(task.data, dict) else None
    if duration:
        time.sleep(float(duration))


def archive(db: Connection, task: Task, result: int, duration: int) -> None:
    """``archiveTask()`` then ``PhabricatorWorkerArchiveTask::save()``, one transaction."""
    check_lease(task)
    now = int(time.time())
    values = {**task.row, "result": result, "duration": duration}
    values.update(archivedEpoch=now, dateModified=now)
    db.query("START TRANSACTION")
    try:
        db.query("DELETE FROM `worker_activetask` WHERE id = %s", (task.id,))
        columns = ", ".join(f"`{c}`" for c in ARCHIVE_COLUMNS)
        marks = ", ".join(["%s"] * len(ARCHIVE_COLUMNS))
        db.query(
            f"INSERT INTO `worker_archivetask` ({columns}) VALUES ({marks})",
            tuple(values[c] for c in ARCHIVE_COLUMNS),
        )
    except BaseException:
        db.query("ROLLBACK")
        raise
    db.query("COMMIT")


def execute_task(db: Connection, task: Task) -> None:
    """``PhabricatorWorkerActiveTask::executeTask()``: its success path."""
    check_lease(task)
    started = time.time()
    do_work(task)
    archive(db, task, RESULT_SUCCESS, int((time.time() - started) * 1_000_000))


def run(db: Connection, records: RecordWriter) -> None:
    """``PhabricatorTaskmasterDaemon::run()``, forever (until SIGTERM/SIGKILL)."""
    sequence, spans = count(1), Spans(records)
    while True:
        task = lease_one(db, lease_owner_name(sequence))
        if task is None:
            time.sleep(IDLE_SLEEP)
            continue
        spans.start(task.id)
        execute_task(db, task)
        spans.end(task.id, "taskmaster", task.id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("--port", "--user", "--password", "--database", "--records", "--ready"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    conn = MySQLdb.connect(
        host="127.0.0.1", port=int(args.port), user=args.user, password=args.password,
        db=args.database, charset="utf8mb4",
    )  # fmt: skip
    conn.autocommit(True)
    Path(args.ready).touch()
    run(Connection(conn), RecordWriter(args.records))


if __name__ == "__main__":
    main()
