"""The bench's request counters, installed on a real MariaDB connection: each way a
query leaves MySQLdb is one round trip, with its statements, counted once."""

from __future__ import annotations

import MySQLdb
import pytest
from benchkit import hook
from benchkit.records import Counters
from MySQLdb.connections import Connection
from MySQLdb.cursors import BaseCursor
from sqlalchemy import Engine

from bridge.queue import make_engine

pytestmark = pytest.mark.mariadb  # tests/conftest.py marks only by its own fixtures


@pytest.fixture
def counted(monkeypatch, mysql_database: Engine):
    """A bridge-configured DBAPI connection with the bench's counters installed (and
    MySQLdb's own methods back afterwards)."""
    for name in ("query", "commit", "rollback", "ping", "autocommit"):
        monkeypatch.setattr(Connection, name, getattr(Connection, name))
    monkeypatch.setattr(BaseCursor, "execute", BaseCursor.execute)
    hook._count_database_requests()
    engine = make_engine(mysql_database.url.render_as_string(hide_password=False))
    raw = engine.raw_connection()
    yield raw.dbapi_connection
    raw.close()
    engine.dispose()


def requests(run) -> dict[str, int]:
    before = Counters(*hook.counters().snapshot())
    run()
    return {k: v for k, v in vars(Counters(*hook.counters().snapshot()) - before).items() if v}


def drain(cursor) -> None:
    while cursor.nextset():
        pass


def test_each_way_a_query_leaves_the_driver_counts_once(counted: MySQLdb.Connection):
    cursor = counted.cursor()
    cursor.execute("CREATE TEMPORARY TABLE t (v VARCHAR(10))")

    def separator_in_a_parameter():
        cursor.execute("SELECT %s; SELECT 2", ("a;b",))
        drain(cursor)

    def bulk_insert():  # MySQLdb sends one INSERT ... VALUES (..), (..) as a bytearray
        cursor.executemany("INSERT INTO t (v) VALUES (%s)", [("x;y",), ("z",)])

    def bare_query():
        counted.query(b"SELECT 1")
        counted.store_result()

    def transaction():
        cursor.execute("START TRANSACTION; DELETE FROM t WHERE v = %s; COMMIT", ("z",))
        drain(cursor)

    assert requests(separator_in_a_parameter) == {"round_trips": 1, "statements": 2}
    assert requests(bulk_insert) == {"round_trips": 1, "statements": 1}
    assert requests(bare_query) == {"round_trips": 1, "statements": 1}
    assert requests(transaction) == {
        "round_trips": 1,
        "begins": 1,
        "statements": 1,
        "commits": 1,
    }
    assert requests(counted.commit) == {"round_trips": 1, "commits": 1}
