"""The two places where MariaDB/MySQL and SQLite differ: the clock and the id counter.

Everything else the bridge says to the database is portable SQLAlchemy Core.
"""

from __future__ import annotations

from sqlalchemy import Connection, Integer, text
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement


class db_now(FunctionElement[int]):
    """The database server's epoch seconds: leases are judged by one clock, never a host's."""

    type = Integer()
    inherit_cache = True


@compiles(db_now)
def _sqlite_now(element, compiler, **kw) -> str:
    return "CAST(strftime('%s', 'now') AS INTEGER)"


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _mysql_now(element, compiler, **kw) -> str:
    return "UNIX_TIMESTAMP()"


class owner_epoch(FunctionElement[int]):
    """When a lease was taken, read off its owner string (``...:epoch:host:sequence``).

    PHP's owners are ``pid:epoch:host:seq`` and the bridge's ``prefix:pid:epoch:host:seq``:
    the epoch is third from the end. PHP's lease leaves ``dateModified`` alone, so this is
    the only trace of when a row was leased. SQLite gets the same rule as a Python
    function (``model.lease_epoch``), registered on connect.
    """

    type = Integer()
    inherit_cache = True


@compiles(owner_epoch)
def _sqlite_owner_epoch(element, compiler, **kw) -> str:
    return f"owner_epoch({compiler.process(element.clauses, **kw)})"


@compiles(owner_epoch, "mysql")
@compiles(owner_epoch, "mariadb")
def _mysql_owner_epoch(element, compiler, **kw) -> str:
    owner = compiler.process(element.clauses, **kw)
    return f"CAST(SUBSTRING_INDEX(SUBSTRING_INDEX({owner}, ':', -3), ':', 1) AS UNSIGNED)"


# Phorge's LiskDAO counter statement (IDS_COUNTER), generalised from +1 to +:n so a
# batch takes one round trip; the sequence stays the one PHP draws from.
_MYSQL_NEXT_IDS = text(
    "INSERT INTO lisk_counter (counterName, counterValue)"
    " VALUES ('worker_activetask', LAST_INSERT_ID(:n))"
    " ON DUPLICATE KEY UPDATE counterValue = LAST_INSERT_ID(counterValue + :n)"
)
_SQLITE_NEXT_IDS = text(
    "INSERT INTO lisk_counter (counterName, counterValue) VALUES ('worker_activetask', :n)"
    " ON CONFLICT (counterName) DO UPDATE SET counterValue = counterValue + :n"
    " RETURNING counterValue"
)


def next_task_ids(conn: Connection, n: int) -> list[int]:
    """Take ``n`` consecutive task ids from ``lisk_counter`` (the caller commits)."""
    if n <= 0:
        return []
    if conn.dialect.name in ("mysql", "mariadb"):
        conn.execute(_MYSQL_NEXT_IDS, {"n": n})
        last = conn.execute(text("SELECT LAST_INSERT_ID()")).scalar_one()
    else:
        last = conn.execute(_SQLITE_NEXT_IDS, {"n": n}).scalar_one()
    return list(range(int(last) - n + 1, int(last) + 1))
