"""bridge/schema.py creates, on MariaDB, exactly the tables of a real Phorge install.

The reference is ``SHOW CREATE TABLE`` read off Phorge (tests/reference/), loaded
into a second database and compared through information_schema, table by table: the
worker database's four tables, and ``config_entry`` from Phorge's config database
(``{namespace}_config``), where the canary keeps its weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa

from bridge.queue.schema import WORKER_TABLES, config_entry, metadata

REFERENCES = Path(__file__).parent.parent / "reference"
WORKER_REFERENCE = REFERENCES / "phorge-worker-schema.sql"
CONFIG_REFERENCE = REFERENCES / "phorge-config-schema.sql"


def reference_statements(*references: Path) -> list[str]:
    """The references' CREATE TABLE statements (each ends with a lone `;` line)."""
    statements = []
    for reference in references or (WORKER_REFERENCE, CONFIG_REFERENCE):
        text = "\n".join(
            line for line in reference.read_text().splitlines() if not line.startswith("--")
        )
        statements += [s.strip() for s in text.split("\n;") if s.strip()]
    return statements


def reference_tables(*references: Path) -> list[str]:
    return [re.match(r"CREATE TABLE `(\w+)`", s)[1] for s in reference_statements(*references)]


# What a column, an index and a table are made of, as information_schema says.
QUERIES = {
    "columns": """
        SELECT ORDINAL_POSITION, COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, COLUMN_DEFAULT,
               CHARACTER_SET_NAME, COLLATION_NAME, EXTRA
        FROM information_schema.COLUMNS
        WHERE TABLE_SCHEMA = :db AND TABLE_NAME = :table ORDER BY ORDINAL_POSITION""",
    "indexes": """
        SELECT INDEX_NAME, SEQ_IN_INDEX, COLUMN_NAME, NON_UNIQUE, SUB_PART, INDEX_TYPE
        FROM information_schema.STATISTICS
        WHERE TABLE_SCHEMA = :db AND TABLE_NAME = :table ORDER BY INDEX_NAME, SEQ_IN_INDEX""",
    "table": """
        SELECT ENGINE, TABLE_COLLATION
        FROM information_schema.TABLES WHERE TABLE_SCHEMA = :db AND TABLE_NAME = :table""",
}


def describe(engine: sa.Engine, table: str) -> dict[str, list[tuple]]:
    with engine.connect() as conn:
        db = conn.exec_driver_sql("SELECT DATABASE()").scalar()
        return {
            what: [tuple(row) for row in conn.execute(sa.text(sql), {"db": db, "table": table})]
            for what, sql in QUERIES.items()
        }


def show_create(engine: sa.Engine, table: str) -> list[str]:
    """SHOW CREATE TABLE, less what does not define the table.

    The counter value (AUTO_INCREMENT=N) and the order of the KEY lines: SQLAlchemy
    creates indexes in no particular order, and the order changes no query plan's
    choice of index.
    """
    with engine.connect() as conn:
        ddl = conn.exec_driver_sql(f"SHOW CREATE TABLE `{table}`").one()[1]
    lines = re.sub(r" AUTO_INCREMENT=\d+", "", ddl).splitlines()
    keys = sorted(line.rstrip(",") for line in lines if line.startswith("  KEY "))
    return [line.rstrip(",") for line in lines if not line.startswith("  KEY ")] + keys


@pytest.fixture
def reference_engine(make_mysql_database) -> sa.Engine:
    """A database holding the reference DDL."""
    engine = make_mysql_database(create_tables=False)
    with engine.begin() as conn:
        for statement in reference_statements():
            conn.exec_driver_sql(statement)
    return engine


def test_same_tables_as_reference():
    assert sorted(metadata.tables) == sorted(reference_tables())
    # The worker database's own tables are exactly those read off phabricator_worker;
    # config_entry is phabricator_config's, never expected in the worker database.
    assert sorted(t.name for t in WORKER_TABLES) == sorted(reference_tables(WORKER_REFERENCE))
    assert reference_tables(CONFIG_REFERENCE) == [config_entry.name]


@pytest.mark.parametrize("table", reference_tables())
def test_table_matches_reference(table, mysql_engine, reference_engine):
    ours, theirs = describe(mysql_engine, table), describe(reference_engine, table)
    for what in QUERIES:
        assert ours[what] == theirs[what], f"{table}: {what} differ from Phorge's"
    assert show_create(mysql_engine, table) == show_create(reference_engine, table)


@pytest.mark.parametrize("attempt", [1, 2])
def test_each_test_starts_with_empty_tables(engine, attempt):
    """Rows round-trip on both backends, and no test sees another's (ids start over)."""
    taskdata, active = metadata.tables["worker_taskdata"], metadata.tables["worker_activetask"]
    with engine.begin() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(active)).scalar() == 0
        inserted = conn.execute(sa.insert(taskdata).values(data="[]"))
        assert inserted.inserted_primary_key[0] == 1
        conn.execute(
            sa.insert(active).values(
                id=10,
                taskClass="PhabricatorTestWorker",
                failureCount=0,
                dataID=1,
                priority=4000,
                objectPHID="PHID-TEST-x",
                dateCreated=1,
                dateModified=1,
            )
        )
        row = conn.execute(sa.select(active.c.objectPHID, active.c.leaseOwner)).one()
    assert tuple(row) == ("PHID-TEST-x", None)
