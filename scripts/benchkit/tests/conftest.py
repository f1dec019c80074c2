"""Fixtures of the bench kit's own tests, which ``pytest`` runs with the product's suite
(``testpaths`` in pyproject.toml).

Outside ``tests/``, they see none of ``tests/conftest.py``'s fixtures; the database comes
from the same helpers (``tests/helpers/services.py``), on the tests' MariaDB. A test that
uses it carries the ``mariadb`` marker itself (``pytestmark``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from services import MYSQL_URL, create_mysql_engine, database, service_url


@pytest.fixture
def mysql_database() -> Iterator[sa.Engine]:
    """An engine on a fresh, empty database of the tests' MariaDB, dropped afterwards."""
    server = create_mysql_engine(service_url(MYSQL_URL))
    try:
        with database(server, create_tables=False) as engine:
            yield engine
    finally:
        server.dispose()
