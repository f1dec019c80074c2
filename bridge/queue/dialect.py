"""Where MariaDB/MySQL and SQLite differ: engine set-up, the clock and the id counter.

Everything else the bridge says to the database is portable SQLAlchemy Core.
"""

from __future__ import annotations

import os
import threading
import zlib
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, Integer, String, create_engine, event, text
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from bridge.queue.implementations import CELERY

if TYPE_CHECKING:
    import sqlite3

    from sqlalchemy.pool import ConnectionPoolEntry
    from sqlalchemy.sql.compiler import SQLCompiler


class db_now(FunctionElement[int]):
    """The database server's epoch seconds: leases are judged by one clock, never a host's."""

    type = Integer()
    inherit_cache = True


@compiles(db_now)
def _sqlite_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    return "CAST(strftime('%s', 'now') AS INTEGER)"


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _mysql_now(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
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
def _sqlite_owner_epoch(element: owner_epoch, compiler: SQLCompiler, **kw: Any) -> str:
    return f"owner_epoch({compiler.process(element.clauses, **kw)})"


@compiles(owner_epoch, "mysql")
@compiles(owner_epoch, "mariadb")
def _mysql_owner_epoch(element: owner_epoch, compiler: SQLCompiler, **kw: Any) -> str:
    owner = compiler.process(element.clauses, **kw)
    return f"CAST(SUBSTRING_INDEX(SUBSTRING_INDEX({owner}, ':', -3), ':', 1) AS UNSIGNED)"


class owner_label(FunctionElement[str]):
    """Who ran a task, read off its lease owner: the fifth field from the end
    (``phd:pid:epoch:host:seq``, ``bridge:native:pid:epoch:host:seq``), NULL for owners
    with fewer fields (Phorge's own ``pid:epoch:host:seq``), as ``model.label_of``;
    SQLite gets that function, registered on connect."""

    type = String()
    inherit_cache = True


@compiles(owner_label)
def _sqlite_owner_label(element: owner_label, compiler: SQLCompiler, **kw: Any) -> str:
    return f"owner_label({compiler.process(element.clauses, **kw)})"


@compiles(owner_label, "mysql")
@compiles(owner_label, "mariadb")
def _mysql_owner_label(element: owner_label, compiler: SQLCompiler, **kw: Any) -> str:
    owner = compiler.process(element.clauses, **kw)
    fields = f"LENGTH({owner}) - LENGTH(REPLACE({owner}, ':', '')) + 1"
    field = f"SUBSTRING_INDEX(SUBSTRING_INDEX({owner}, ':', -5), ':', 1)"
    return f"(CASE WHEN {fields} >= 5 THEN {field} END)"


BUCKETS = 10_000  # a canary's buckets: its weights' scale (basis points)


class celery_bucket(FunctionElement[int]):
    """A task id's bucket at the canary's ``celery`` level, 0 to 9999:
    ``CRC32(CONCAT('celery:', id)) % 10000``, as PHP's ``crc32()`` and Python's
    ``zlib.crc32`` (``bridge.canary.weights.bucket``) compute it. SQLite gets ``crc32``
    as a Python function, registered on connect.
    """

    type = Integer()
    inherit_cache = True


@compiles(celery_bucket)
def _sqlite_celery_bucket(element: celery_bucket, compiler: SQLCompiler, **kw: Any) -> str:
    task_id = compiler.process(element.clauses, **kw)
    return f"(crc32('{CELERY}:' || {task_id}) % {BUCKETS})"


@compiles(celery_bucket, "mysql")
@compiles(celery_bucket, "mariadb")
def _mysql_celery_bucket(element: celery_bucket, compiler: SQLCompiler, **kw: Any) -> str:
    # MOD(), not %: the driver's paramstyle would want the percent sign doubled.
    task_id = compiler.process(element.clauses, **kw)
    return f"MOD(CRC32(CONCAT('{CELERY}:', {task_id})), {BUCKETS})"


def _crc32(text: Any) -> int | None:
    """MySQL's ``CRC32()`` for SQLite: of the UTF-8 bytes, unsigned."""
    return None if text is None else zlib.crc32(str(text).encode())


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


def is_mysql(engine: Engine) -> bool:
    return engine.dialect.name in ("mysql", "mariadb")


def lock_key(engine: Engine, name: str) -> str:
    """A named lock's key: named locks are per server, so the database name is part of
    it (MySQL allows 64 characters)."""
    return f"phorge-bridge:{engine.url.database}:{name}"[:64]


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine configured for Phorge's tables on MariaDB/MySQL or SQLite."""
    if url.startswith("sqlite"):
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    from MySQLdb.constants.CLIENT import FOUND_ROWS, MULTI_STATEMENTS

    connect_args = {
        "charset": "utf8mb4",
        # Phorge runs with STRICT_ALL_TABLES; a write it would refuse is refused here too.
        "init_command": "SET SESSION sql_mode = 'STRICT_ALL_TABLES'",
        # FOUND_ROWS: an UPDATE's row count is the rows its guard matched (SQLAlchemy's
        # own default), so renewing a lease within the same second still counts as held.
        # MULTI_STATEMENTS: a task's outcome is one transaction sent in one round trip
        # (``session.LeaseSession``); every value is still a bound parameter.
        "client_flag": FOUND_ROWS | MULTI_STATEMENTS,
    }
    connect_args.update(kwargs.pop("connect_args", {}))
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_recycle", 3600)
    # Each thread's LeaseSession holds one connection for the thread's life: a threads
    # pool of 32 must not wait on a pool of 5 + 10, so overflow is unbounded (it is
    # bounded by the threads that use the engine).
    kwargs.setdefault("max_overflow", -1)
    return create_engine(url, connect_args=connect_args, **kwargs)


LOCK_IDLE_TIMEOUT = 10  # seconds the server keeps a silent lock holder's session
_lock_engines: dict[tuple[int, str], Engine] = {}
_lock_engines_mutex = threading.Lock()


def lock_engine(engine: Engine) -> Engine:
    """The engine for named locks held across other work (the poll lock, the guard's):
    its sessions end after :data:`LOCK_IDLE_TIMEOUT` seconds of silence, so a holder
    whose host vanished frees its lock that soon (pre-ping replaces a connection the
    server ended while pooled). One per process, so a prefork child has its own."""
    if not is_mysql(engine):
        return engine
    url = engine.url.render_as_string(hide_password=False)
    key = (os.getpid(), url)
    with _lock_engines_mutex:
        if key not in _lock_engines:
            init = f"SET SESSION sql_mode = 'STRICT_ALL_TABLES', wait_timeout = {LOCK_IDLE_TIMEOUT}"
            _lock_engines[key] = make_engine(url, connect_args={"init_command": init})
        return _lock_engines[key]


def _sqlite_pragmas(dbapi_connection: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
    # WAL lets readers (the poller, the CLI) run beside one writer; busy_timeout makes
    # concurrent writers wait instead of failing at once. Transactions are begun by
    # ``_sqlite_begin`` instead of pysqlite, so a read-then-write cannot lose its snapshot.
    from bridge.queue.model import label_of, lease_epoch

    dbapi_connection.isolation_level = None
    dbapi_connection.create_function("owner_epoch", 1, lease_epoch, deterministic=True)
    dbapi_connection.create_function("crc32", 1, _crc32, deterministic=True)
    dbapi_connection.create_function("owner_label", 1, label_of, deterministic=True)
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    # Writers take the write lock up front (a deferred read-then-write could lose its
    # snapshot); readers take none and read the last committed state beside them.
    write = conn.get_execution_options().get("bridge_write")
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")
