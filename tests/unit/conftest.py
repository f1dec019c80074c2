"""Fixtures of the unit tests that more than one module uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from bridge.config import Settings, load_settings
from bridge.queue import make_engine
from bridge.queue.schema import metadata


@pytest.fixture
def db(tmp_path) -> Iterator[tuple[sa.Engine, Settings]]:
    """A SQLite queue database with Phorge's tables, and settings pointing at it."""
    url = f"sqlite:///{tmp_path / 'q.db'}"
    engine = make_engine(url)
    metadata.create_all(engine)
    yield engine, load_settings({"BRIDGE_DATABASE_URL": url})
    engine.dispose()
