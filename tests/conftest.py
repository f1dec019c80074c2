"""Fixtures for real services: MariaDB, RabbitMQ and Redis started by ``scripts/test.sh``.

The services' addresses come from ``PHORGE_BRIDGE_TEST_*`` environment variables
(``scripts/services.sh env``). A missing variable fails the test instead of
skipping it: a skipped test proves nothing. The lookup and the throwaway databases are
``tests/helpers/services.py``'s, shared with the bench kit's tests.

MariaDB isolation: each test module gets its own database ``bridge_t_<hex>``
with Phorge's four tables (about 35 ms to create), and every test starts from
empty tables (TRUNCATE of the four, about 6 ms), so ids and ``AUTO_INCREMENT``
start over. Unique names keep concurrent runs on one server apart.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from services import MYSQL_URL, create_mysql_engine, database, service_url, url_of

from bridge.cli.main import main
from bridge.queue import PhorgeQueue, make_engine
from bridge.queue.schema import metadata

# The real-Phorge tier (tests/phorge/) drives a Phorge checkout: collected only when
# PHORGE_ROOT names one (scripts/test.sh provides Phorge's and Phabricator's in turn);
# otherwise the run's summary says it was left out.
PHORGE_TIER_LEFT_OUT = not os.environ.get("PHORGE_ROOT")
if PHORGE_TIER_LEFT_OUT:
    collect_ignore = ["phorge"]


# Fixtures that reach each service, for marking tests (pytest -m "not mariadb").
_SERVICE_MARKERS = {"mysql_url": "mariadb", "amqp_url": "rabbitmq", "redis_url": "redis"}


LONG_FAULT_TIMEOUT = 1800  # seconds a long variant may take (10 broker restarts, 30,000 tasks)


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here, not in tests/faults/conftest.py: pytest reads options before it collects there.
    parser.addoption(
        "--long-faults",
        action="store_true",
        help="run the fault suite's long variants (30 s database stall, 30,000-task soak)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    long_faults = config.getoption("--long-faults")
    for item in items:
        for fixture, marker in _SERVICE_MARKERS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
        if long_faults and "faults" in item.path.parts:
            # The long variants outgrow the suite's per-test timeout (pyproject.toml).
            item.add_marker(pytest.mark.timeout(LONG_FAULT_TIMEOUT))


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    tier = Path(__file__).with_name("phorge")
    asked = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
    if PHORGE_TIER_LEFT_OUT and any(
        tier.is_relative_to(p) or p.is_relative_to(tier) for p in asked
    ):
        terminalreporter.write_line(
            "real-Phorge tier (tests/phorge) not run: PHORGE_ROOT is not set "
            "(bash scripts/test.sh runs it on Phorge and Phabricator)"
        )


@pytest.fixture(scope="session")
def mysql_url() -> str:
    """The MariaDB server URL, without a database."""
    return service_url(MYSQL_URL)


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """The RabbitMQ broker URL."""
    return service_url("PHORGE_BRIDGE_TEST_AMQP_URL")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis URL, without a database number."""
    return service_url("PHORGE_BRIDGE_TEST_REDIS_URL")


@pytest.fixture(params=["rabbitmq", "redis"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """Each real Celery broker in turn."""
    return request.getfixturevalue("amqp_url" if request.param == "rabbitmq" else "redis_url")


@pytest.fixture(scope="session")
def mysql_server(mysql_url: str) -> Iterator[sa.Engine]:
    """An engine on the server itself (no database): CREATE/DROP DATABASE, information_schema."""
    engine = create_mysql_engine(mysql_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def _mysql_module_engine(mysql_server: sa.Engine) -> Iterator[sa.Engine]:
    with database(mysql_server, create_tables=True) as engine:
        yield engine


@pytest.fixture
def mysql_engine(_mysql_module_engine: sa.Engine) -> sa.Engine:
    """An engine on a MariaDB database holding Phorge's four tables, empty.

    The database is shared by the tests of one module; ``mysql_engine.url`` (with
    ``render_as_string(hide_password=False)``) is what to hand a subprocess.
    """
    with _mysql_module_engine.begin() as conn:
        # A connection a previous test leaked would block TRUNCATE forever: fail instead.
        conn.exec_driver_sql("SET SESSION lock_wait_timeout = 10")
        for table in metadata.sorted_tables:
            conn.exec_driver_sql(f"TRUNCATE TABLE `{table.name}`")
    return _mysql_module_engine


@pytest.fixture
def mysql_queue(mysql_engine: sa.Engine) -> Iterator[PhorgeQueue]:
    """A queue on ``mysql_engine``'s database, through an engine of the product's own
    settings (``make_engine``), disposed of afterwards."""
    queue = PhorgeQueue(make_engine(url_of(mysql_engine)))
    yield queue
    queue.engine.dispose()


@pytest.fixture
def cli_invoke(mysql_engine: sa.Engine, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """Run ``phorge-bridge`` against the test database, with no other ``BRIDGE_`` setting:
    ``cli_invoke("list", code=0)`` asserts the exit code and returns the output."""
    for name in os.environ:
        if name.startswith("BRIDGE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("BRIDGE_DATABASE_URL", url_of(mysql_engine))
    runner = CliRunner()

    def invoke(*args: str, code: int = 0) -> str:
        result = runner.invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == code, result.output
        return result.output

    return invoke


@pytest.fixture
def make_mysql_database(mysql_server: sa.Engine) -> Iterator[Callable[..., sa.Engine]]:
    """A factory of fresh MariaDB databases, dropped after the test.

    ``make_mysql_database(create_tables=False)`` gives an empty database.
    """
    with ExitStack() as stack:

        def make(*, create_tables: bool = True) -> sa.Engine:
            return stack.enter_context(database(mysql_server, create_tables=create_tables))

        yield make


@pytest.fixture
def sqlite_engine(tmp_path) -> Iterator[sa.Engine]:
    """An engine on a file-based SQLite database holding Phorge's four tables, empty."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'phorge.sqlite3'}")
    metadata.create_all(engine)
    yield engine
    engine.dispose()


_ENGINE_FIXTURES = {"sqlite": "sqlite_engine", "mariadb": "mysql_engine"}


@pytest.fixture(params=["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)])
def engine(request: pytest.FixtureRequest) -> sa.Engine:
    """``sqlite_engine`` and ``mysql_engine`` in turn, for behaviour that must hold on both."""
    return request.getfixturevalue(_ENGINE_FIXTURES[request.param])
