"""The test services' addresses, and throwaway MariaDB databases on the test server.

Shared by ``tests/conftest.py`` and ``scripts/benchkit/tests/conftest.py`` (the bench
kit's own tests, which live outside ``tests/`` and so see none of its fixtures). The
addresses come from ``PHORGE_BRIDGE_TEST_*`` environment variables (``scripts/services.sh
env``); a missing one fails the test instead of skipping it: a skipped test proves nothing.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from bridge.queue.schema import metadata

# What Phorge runs with: strict mode, UTC; utf8mb4 like its tables.
MYSQL_CONNECT_ARGS = {
    "charset": "utf8mb4",
    "init_command": "SET sql_mode='STRICT_ALL_TABLES', time_zone='+00:00'",
}
MYSQL_URL = "PHORGE_BRIDGE_TEST_MYSQL_URL"


def service_url(variable: str) -> str:
    url = os.environ.get(variable)
    if not url:
        pytest.fail(
            f"{variable} is not set: run the tests with `bash scripts/test.sh`, which starts "
            'MariaDB, RabbitMQ and Redis (or `eval "$(scripts/services.sh env)"` after '
            "`scripts/services.sh start`)",
            pytrace=False,
        )
    return url


def url_of(engine: sa.Engine) -> str:
    """``engine``'s URL with its password, as a subprocess or the bridge's settings take it."""
    return engine.url.render_as_string(hide_password=False)


def create_mysql_engine(url: str | sa.URL) -> sa.Engine:
    """An engine on the test MariaDB, connecting as Phorge does."""
    return sa.create_engine(url, connect_args=MYSQL_CONNECT_ARGS, pool_pre_ping=True)


@contextmanager
def database(server: sa.Engine, *, create_tables: bool) -> Iterator[sa.Engine]:
    """A fresh database ``bridge_t_<hex>`` on ``server`` (with Phorge's four tables if
    ``create_tables``), dropped afterwards. Unique names keep concurrent runs apart."""
    name = f"bridge_t_{secrets.token_hex(6)}"
    with server.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{name}`")
    engine = create_mysql_engine(server.url.set(database=name))
    try:
        if create_tables:
            metadata.create_all(engine)
        yield engine
    finally:
        engine.dispose()
        with server.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{name}`")
