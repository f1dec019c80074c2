"""The reference taskmaster leases, runs and archives as Phorge's does, at Phorge's cost:
the baseline every ratio of the report divides by."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import pytest
from benchkit import phorgedb, records, taskmaster
from MySQLdb.connections import Connection
from MySQLdb.cursors import BaseCursor

pytestmark = pytest.mark.mariadb
DDL = Path(__file__).resolve().parents[3] / "tests" / "reference" / "phorge-worker-schema.sql"


@pytest.fixture
def db(mysql_conn, monkeypatch):
    """Phorge's queue tables, and the bench's request counters on MySQLdb (undone after)."""
    for name in ("query", "commit", "rollback", "ping", "autocommit"):
        monkeypatch.setattr(Connection, name, getattr(Connection, name))
    monkeypatch.setattr(BaseCursor, "execute", BaseCursor.execute)
    cur = mysql_conn.cursor()
    text = "\n".join(line for line in DDL.read_text().splitlines() if not line.startswith("--"))
    for statement in filter(str.strip, text.split(";")):
        cur.execute(statement)
    records.count_requests()
    return mysql_conn


def row(db, task_id: int, table: str = "worker_activetask") -> dict:
    rows, _ = taskmaster.query(db, f"SELECT * FROM {table} WHERE id = %s", (task_id,))
    return rows[0] if rows else {}


def test_it_leases_the_most_urgent_row_for_two_hours_then_the_oldest_expired(db):
    batch = phorgedb.enqueue(db, 3, '{"duration":0.001}')
    taskmaster.query(
        db, "UPDATE worker_activetask SET priority = 1000 WHERE id = %s", (batch.last,)
    )
    sequence = itertools.count(1)
    task = taskmaster.lease_one(db, taskmaster.lease_owner_name(sequence))
    assert task is not None and task.id == batch.last and task.data == {"duration": 0.001}
    leased = row(db, task.id)
    pid, _, _, seq = leased["leaseOwner"].split(":")
    assert (pid, seq) == (str(os.getpid()), "1")
    assert abs(leased["leaseExpires"] - (task.server_time + 7200)) <= 1
    assert taskmaster.lease_one(db, taskmaster.lease_owner_name(sequence)).id == batch.first

    expired = batch.first + 1  # leased by a dead taskmaster: the "expired" phase takes it
    dead = "UPDATE worker_activetask SET leaseOwner = 'x', leaseExpires = 1 WHERE id = %s"
    taskmaster.query(db, dead, (expired,))
    assert taskmaster.lease_one(db, taskmaster.lease_owner_name(sequence)).id == expired
    assert taskmaster.lease_one(db, taskmaster.lease_owner_name(sequence)) is None


def test_a_task_runs_its_duration_and_is_archived_in_seven_round_trips_one_commit(db):
    batch = phorgedb.enqueue(db, 1, '{"duration":0.02}')
    before = records.counters()
    started = time.time()
    task = taskmaster.lease_one(db, taskmaster.lease_owner_name(itertools.count(1)))
    taskmaster.execute_task(db, task)
    assert time.time() - started >= 0.02
    spent = [after - b for after, b in zip(records.counters(), before, strict=True)]
    assert spent == [5, 1, 7]  # statements, commits, round trips
    archived = row(db, batch.first, "worker_archivetask")
    assert (archived["result"], archived["leaseOwner"]) == (0, task.row["leaseOwner"])
    assert archived["duration"] >= 20_000 and not row(db, batch.first)
    assert phorgedb.progress(db, batch) == (0, 0, 1) and phorgedb.failed(db, batch) == 0
