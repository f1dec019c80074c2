"""A reference taskmaster: Phorge's PHP taskmaster loop (07c1a51310), statement for
statement, in Python, so every ratio has a baseline on the same database without PHP.

    python3 -m benchkit.taskmaster PORT RECORDS READY

Followed: ``PhabricatorTaskmasterDaemon::run()`` (lease ONE task, run it, ``sleep(1)`` when
idle), ``PhabricatorWorkerLeaseQuery`` (phases "unleased" then "expired": SELECT, UPDATE
on the same condition, then the joined read), ``executeTask()`` (``checkLease()`` from the
server time, ``archiveTask()`` in one transaction), ``PhabricatorTestWorker`` (a sleep).
One autocommit connection, text statements as ``qsprintf``. Left out: the overseer, PHP
(compare round trips and commits, not CPU) and every path but success. SIGTERM ends it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import MySQLdb

from benchkit.mariadb import PASSWORD, USER
from benchkit.phorgedb import DATABASE
from benchkit.records import RecordWriter, Spans

DEFAULT_LEASE = 2 * 60 * 60  # PhabricatorWorkerLeaseQuery::getDefaultLeaseDuration
IDLE_SLEEP = 1  # PhabricatorTaskmasterDaemon: "When there's no work, sleep for one second."
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


def query(conn: MySQLdb.Connection, sql: str, args: Any = None) -> tuple[list[Any], int]:
    """(rows as dicts, affected rows) of one statement, as ``queryfx``."""
    cur = conn.cursor(MySQLdb.cursors.DictCursor)
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


def lease_one(conn: MySQLdb.Connection, owner: str) -> Task | None:
    """``PhabricatorWorkerLeaseQuery->setLimit(1)->execute()``: each phase until one leases."""
    for phase, (where, order) in PHASES.items():
        select = f"SELECT id, leaseOwner FROM `worker_activetask` {where} {order} LIMIT 1"
        rows, _ = query(conn, select)
        if not rows:
            continue
        row = rows[0]
        if phase == "unleased":
            condition, keys = f"WHERE leaseOwner IS NULL AND id IN ({int(row['id'])})", ()
        else:
            condition, keys = "WHERE (id = %s AND leaseOwner = %s)", (row["id"], row["leaseOwner"])
        update = "UPDATE `worker_activetask` task SET leaseOwner = %s,"
        update += f" leaseExpires = UNIX_TIMESTAMP() + %s {condition}"
        if query(conn, update, (owner, DEFAULT_LEASE, *keys))[1]:
            break
    else:
        return None
    rows, _ = query(
        conn,
        "SELECT task.*, taskdata.data _taskData, UNIX_TIMESTAMP() _serverTime"
        " FROM `worker_activetask` task LEFT JOIN `worker_taskdata` taskdata"
        " ON taskdata.id = task.dataID WHERE task.leaseOwner = %s"
        f" AND leaseExpires > UNIX_TIMESTAMP() {order} LIMIT 1",
        (owner,),
    )
    if not rows:
        return None
    row, raw = rows[0], rows[0].pop("_taskData")
    data = json.loads(raw) if raw else None
    return Task(row, data, int(row.pop("_serverTime")), int(time.time()))


def check_lease(task: Task) -> None:
    """``checkLease()``: judged locally from the server time read at lease."""
    owner = task.row["leaseOwner"]
    now = task.server_time + (int(time.time()) - task.local_time)
    if owner and owner != "(yield)" and now >= int(task.row["leaseExpires"]):
        raise RuntimeError(f"Trying to update Task {task.id} after lease expiration!")


def execute_task(conn: MySQLdb.Connection, task: Task) -> None:
    """``executeTask()``'s success path: ``PhabricatorTestWorker::doWork()`` sleeps for the
    task's ``duration``, then ``archiveTask()`` and the archive's ``save()``, one transaction."""
    check_lease(task)
    started = time.time()
    if isinstance(task.data, dict) and task.data.get("duration"):
        time.sleep(float(task.data["duration"]))
    duration = int((time.time() - started) * 1_000_000)
    check_lease(task)
    now = int(time.time())
    values = {**task.row, "result": 0, "duration": duration}
    values.update(archivedEpoch=now, dateModified=now)
    columns, marks = ", ".join(f"`{c}`" for c in ARCHIVE_COLUMNS), ["%s"] * len(ARCHIVE_COLUMNS)
    query(conn, "START TRANSACTION")
    try:
        query(conn, "DELETE FROM `worker_activetask` WHERE id = %s", (task.id,))
        insert = f"INSERT INTO `worker_archivetask` ({columns}) VALUES ({', '.join(marks)})"
        query(conn, insert, tuple(values[c] for c in ARCHIVE_COLUMNS))
    except BaseException:
        query(conn, "ROLLBACK")
        raise
    query(conn, "COMMIT")


def main(port: str, records: str, ready: str) -> None:
    """``PhabricatorTaskmasterDaemon::run()``, forever (until SIGTERM/SIGKILL)."""
    login = {"user": USER, "password": PASSWORD, "db": DATABASE, "charset": "utf8mb4"}
    conn = MySQLdb.connect(host="127.0.0.1", port=int(port), **login)
    conn.autocommit(True)
    Path(ready).touch()
    sequence, spans = count(1), Spans(RecordWriter(records))
    while True:
        task = lease_one(conn, lease_owner_name(sequence))
        if task is None:
            time.sleep(IDLE_SLEEP)
            continue
        spans.start(task.id)
        execute_task(conn, task)
        spans.end(task.id, "taskmaster", task.id)


if __name__ == "__main__":
    main(*sys.argv[1:])
