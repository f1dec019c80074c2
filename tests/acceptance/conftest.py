"""The bridge end to end: real ``celery worker`` and ``celery beat`` processes.

The fixtures here hand out :class:`bridge_harness.Bridge` deployments (``tests/helpers/
bridge_harness.py``), all stopped at teardown, and the MariaDB databases they run on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from bridge_harness import Bridge, clean_environ, deployments
from prometheus_tools import Prometheus
from sqlalchemy import Engine


@pytest.fixture
def make_bridge(tmp_path: Path) -> Iterator[Callable[..., Bridge]]:
    """A factory of :class:`Bridge` deployments, all stopped at teardown.

    ``make_bridge(database_url, broker_url, POLL_INTERVAL="0.5", ...)``: keyword
    arguments are ``BRIDGE_*`` settings without the prefix.
    """
    with deployments(tmp_path, Bridge) as make:
        yield make


@pytest.fixture(scope="module")
def make_module_bridge(tmp_path_factory) -> Iterator[Callable[..., Bridge]]:
    """``make_bridge`` for a deployment that serves every test of a module."""
    with deployments(tmp_path_factory.mktemp("module"), Bridge) as make:
        yield make


def _url_of(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


@pytest.fixture
def bridge_environ() -> dict[str, str]:
    """This process's environment without BRIDGE_ settings, for a subprocess to add to."""
    return clean_environ()


@pytest.fixture
def database_url(mysql_engine: Engine) -> str:
    """A MariaDB database with Phorge's tables, empty, as a URL for subprocesses."""
    return _url_of(mysql_engine)


@pytest.fixture(scope="module")
def module_database_url(_mysql_module_engine: Engine) -> str:
    """The module's MariaDB database (not emptied between tests), as a URL."""
    return _url_of(_mysql_module_engine)


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[[list[str]], Prometheus]]:
    """Start a real Prometheus scraping ``targets`` (``host:port``); stopped at teardown."""
    servers: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        servers.append(Prometheus(tmp_path, targets))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
