"""The kit's tests' fixtures: they see none of ``tests/``; the database comes from the same
helpers, on the tests' MariaDB (a test using it carries the ``mariadb`` marker)."""

from __future__ import annotations

from collections.abc import Iterator

import MySQLdb
import pytest
from services import MYSQL_URL, create_mysql_engine, database, service_url


@pytest.fixture
def mysql_conn() -> Iterator[MySQLdb.Connection]:
    """A MySQLdb connection (autocommit on) to a fresh database, dropped afterwards."""
    server = create_mysql_engine(service_url(MYSQL_URL))
    try:
        with database(server, create_tables=False) as engine:
            url = engine.url
            login = {"user": url.username, "password": url.password or "", "db": url.database}
            conn = MySQLdb.connect(host=url.host, port=url.port or 3306, charset="utf8mb4", **login)
            conn.autocommit(True)
            yield conn
            conn.close()
    finally:
        server.dispose()
