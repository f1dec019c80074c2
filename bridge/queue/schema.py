"""Phorge's four worker-queue tables as SQLAlchemy Core, column for column, and its
config table.

These mirror ``SHOW CREATE TABLE`` of a real install (``tests/reference/
phorge-worker-schema.sql``, ``phorge-config-schema.sql``): unsigned ints, nullability,
key names, utf8mb4 with the binary collation. The bridge never alters them;
``create_all`` is only for tests and the embedded SQLite default.

Two tables live outside the worker database. ``config_entry`` (``{namespace}_config``)
holds the canary's weights and state (``bridge.canary``): it is in ``metadata``
so that SQLite and the tests' databases get it beside the queue, and
:func:`config_entry_in` addresses Phorge's own copy. ``daemon_log`` (``{namespace}_daemon``)
is read by doctor and written by ``bridge.runtime.daemon_console``; it is never created.
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypedDict, cast

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeEngine


class _MySQLTableOptions(TypedDict):
    mysql_engine: str
    mysql_charset: str
    mysql_collate: str
    mariadb_engine: str
    mariadb_charset: str
    mariadb_collate: str


_MYSQL_TABLE: _MySQLTableOptions = {
    "mysql_engine": "InnoDB",
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
    "mariadb_engine": "InnoDB",
    "mariadb_charset": "utf8mb4",
    "mariadb_collate": "utf8mb4_bin",
}

UInt = Integer().with_variant(mysql.INTEGER(unsigned=True), "mysql", "mariadb")
UBigInt = BigInteger().with_variant(mysql.BIGINT(unsigned=True), "mysql", "mariadb")
Bool = Integer().with_variant(mysql.TINYINT(1), "mysql", "mariadb")  # Lisk's 'bool'
LongText = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


class PHID(TypeDecorator[str]):
    """A PHID column: ``varbinary(64)`` in Phorge, a ``str`` in Python."""

    impl = LargeBinary
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.VARBINARY(64))
        return dialect.type_descriptor(LargeBinary(64))

    def process_bind_param(self, value: str | None, dialect: Dialect) -> bytes | None:
        return None if value is None else value.encode("utf-8")

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        return None if value is None else bytes(value).decode("utf-8")


metadata = MetaData()

worker_activetask = Table(
    "worker_activetask",
    metadata,
    Column("id", UInt, primary_key=True, autoincrement=False),
    Column("taskClass", String(64), nullable=False),
    Column("leaseOwner", String(64), nullable=True),
    Column("leaseExpires", UInt, nullable=True),
    Column("failureCount", UInt, nullable=False),
    Column("dataID", UInt, nullable=False),
    Column("failureTime", UInt, nullable=True),
    Column("priority", UInt, nullable=False),
    Column("objectPHID", PHID, nullable=True),
    Column("dateCreated", UInt, nullable=False),
    Column("dateModified", UInt, nullable=False),
    Column("containerPHID", PHID, nullable=True),
    Index("leaseExpires", "leaseExpires"),
    Index("key_failuretime", "failureTime"),
    Index("taskClass", "taskClass"),
    Index("key_owner", "leaseOwner", "priority", "id"),
    Index("key_object", "objectPHID"),
    Index("key_container", "containerPHID"),
    **_MYSQL_TABLE,
)

worker_archivetask = Table(
    "worker_archivetask",
    metadata,
    Column("id", UInt, primary_key=True, autoincrement=False),
    Column("taskClass", String(64), nullable=False),
    Column("leaseOwner", String(64), nullable=True),
    Column("leaseExpires", UInt, nullable=True),
    Column("failureCount", UInt, nullable=False),
    Column("dataID", UInt, nullable=False),
    Column("result", UInt, nullable=False),
    Column("duration", UBigInt, nullable=False),
    Column("dateCreated", UInt, nullable=False),
    Column("dateModified", UInt, nullable=False),
    Column("priority", UInt, nullable=False),
    Column("objectPHID", PHID, nullable=True),
    Column("archivedEpoch", UInt, nullable=True),
    Column("containerPHID", PHID, nullable=True),
    Index("dateCreated", "dateCreated"),
    Index("key_modified", "dateModified"),
    Index("archive_key_object", "objectPHID").ddl_if(dialect="sqlite"),
    # ddl_if takes a tuple of dialect names (documented, and DDLIf checks for one), but
    # SQLAlchemy annotates ``dialect`` as ``str | None``.
    Index("key_object", "objectPHID").ddl_if(dialect=cast(str, ("mysql", "mariadb"))),
    Index("archive_key_container", "containerPHID").ddl_if(dialect="sqlite"),
    Index("key_container", "containerPHID").ddl_if(dialect=cast(str, ("mysql", "mariadb"))),
    **_MYSQL_TABLE,
)

worker_taskdata = Table(
    "worker_taskdata",
    metadata,
    Column("id", UInt, primary_key=True, autoincrement=True),
    Column("data", LongText, nullable=False),
    sqlite_autoincrement=True,
    **_MYSQL_TABLE,
)

lisk_counter = Table(
    "lisk_counter",
    metadata,
    Column("counterName", String(32), primary_key=True),
    Column("counterValue", UBigInt, nullable=False),
    **_MYSQL_TABLE,
)


config_entry = Table(
    "config_entry",
    metadata,
    Column("id", UInt, primary_key=True, autoincrement=True),
    Column("phid", PHID, nullable=False),
    Column("namespace", String(64), nullable=False),
    Column("configKey", String(64), nullable=False),
    Column("value", LongText, nullable=False),
    Column("isDeleted", Bool, nullable=False),
    Column("dateCreated", UInt, nullable=False),
    Column("dateModified", UInt, nullable=False),
    UniqueConstraint("phid", name="key_phid"),
    UniqueConstraint("namespace", "configKey", name="key_name"),
    sqlite_autoincrement=True,
    **_MYSQL_TABLE,
)
"""Phorge's ``{namespace}_config.config_entry`` (PhabricatorConfigEntry): one row per
option set with ``bin/config set --database``, its value JSON."""

# The worker database's own tables, those ``tests/reference/phorge-worker-schema.sql``
# and doctor's table check compare, by name.
WORKER_TABLES = (lisk_counter, worker_activetask, worker_archivetask, worker_taskdata)


@cache
def config_entry_in(database: str | None) -> Table:
    """``config_entry`` in ``database`` (schema-qualified, as ``{namespace}_config``
    beside the worker database), or the one in ``metadata`` when None (the same database:
    SQLite, the tests' databases)."""
    if database is None:
        return config_entry
    return config_entry.to_metadata(MetaData(), schema=database)


def beside(worker_database: str | None, name: str) -> str | None:
    """Phorge's database ``{namespace}_{name}`` beside the worker database
    ``{namespace}_worker``; None when the worker database is not named so (SQLite, a
    test's database)."""
    if not worker_database or not worker_database.endswith("_worker"):
        return None
    return worker_database.removesuffix("_worker") + f"_{name}"


def daemon_log(database: str) -> Table:
    """Phorge's daemon log in ``database`` (``{namespace}_daemon``, beside the worker
    database), less ``id`` (auto-increment). Not in ``metadata``."""
    return Table(
        "daemon_log",
        MetaData(),
        Column("daemon", String(255), nullable=False),
        Column("host", String(255), nullable=False),
        Column("pid", UInt, nullable=False),
        Column("argv", LongText, nullable=False),
        Column("explicitArgv", LongText, nullable=False),
        Column("dateCreated", UInt, nullable=False),
        Column("dateModified", UInt, nullable=False),
        Column("status", String(8), nullable=False),
        Column("runningAsUser", String(255), nullable=True),
        Column("daemonID", String(64), nullable=False),
        schema=database,
    )


# The one place Phorge's column names meet Python's: a row read into a ``Task`` is
# selected with these labels (``statements.task_columns``), so the record's fields are
# snake_case and no per-row renaming runs.
FIELDS: dict[str, str] = {
    "id": "id",
    "taskClass": "task_class",
    "leaseOwner": "lease_owner",
    "leaseExpires": "lease_expires",
    "failureCount": "failure_count",
    "dataID": "data_id",
    "failureTime": "failure_time",
    "priority": "priority",
    "objectPHID": "object_phid",
    "containerPHID": "container_phid",
    "dateCreated": "date_created",
    "dateModified": "date_modified",
    "result": "result",
    "duration": "duration",
    "archivedEpoch": "archived_epoch",
}
