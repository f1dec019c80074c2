"""Phorge's four worker-queue tables as SQLAlchemy Core, column for column.

These mirror ``SHOW CREATE TABLE`` of a real install (``tests/reference/
phorge-worker-schema.sql``): unsigned ints, nullability, key names, utf8mb4 with the
binary collation. The bridge never alters them; ``create_all`` is only for tests and
the embedded SQLite default.
"""

from __future__ import annotations

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
)
from sqlalchemy.dialects import mysql

_MYSQL_TABLE = {
    "mysql_engine": "InnoDB",
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
    "mariadb_engine": "InnoDB",
    "mariadb_charset": "utf8mb4",
    "mariadb_collate": "utf8mb4_bin",
}

UInt = Integer().with_variant(mysql.INTEGER(unsigned=True), "mysql", "mariadb")
UBigInt = BigInteger().with_variant(mysql.BIGINT(unsigned=True), "mysql", "mariadb")
LongText = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


class PHID(TypeDecorator[str]):
    """A PHID column: ``varbinary(64)`` in Phorge, a ``str`` in Python."""

    impl = LargeBinary
    cache_ok = True

    def load_dialect_impl(self, dialect):
        if dialect.name in ("mysql", "mariadb"):
            return dialect.type_descriptor(mysql.VARBINARY(64))
        return dialect.type_descriptor(LargeBinary(64))

    def process_bind_param(self, value, dialect):
        return None if value is None else value.encode("utf-8")

    def process_result_value(self, value, dialect):
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
    Index("key_object", "objectPHID").ddl_if(dialect=("mysql", "mariadb")),
    Index("archive_key_container", "containerPHID").ddl_if(dialect="sqlite"),
    Index("key_container", "containerPHID").ddl_if(dialect=("mysql", "mariadb")),
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
