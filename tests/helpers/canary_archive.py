"""Archive rows of the canary's tests on SQLite (``tests/unit/test_canary_guard.py`` and
``test_canary_versions.py``, on ``tests/unit/conftest.py``'s ``db``): rows archived as
a side ran them."""

from __future__ import annotations

import itertools
import time

import sqlalchemy as sa

from bridge.queue.schema import worker_archivetask as archive

TASK_IDS = itertools.count(1)  # the ids of every row written here


def archived(
    engine: sa.Engine,
    owner: str | None,
    *,
    count: int = 1,
    task_class: str = "C",
    result: int = 0,
    failures: int = 0,
    duration_us: int = 10_000,
    age: int = 0,
) -> None:
    """``count`` archive rows of ``task_class`` run by ``owner``, archived ``age`` s ago."""
    now = int(time.time())
    rows = [
        {
            "id": next(TASK_IDS),
            "taskClass": task_class,
            "leaseOwner": owner,
            "leaseExpires": now + 60,
            "failureCount": failures,
            "dataID": 1,
            "result": result,
            "duration": duration_us,
            "dateCreated": now - age,
            "dateModified": now - age,
            "priority": 3000,
        }
        for _ in range(count)
    ]
    with engine.begin() as conn:
        conn.execute(sa.insert(archive), rows)


def owner(label: str) -> str:
    return f"bridge:{label}:100:{int(time.time())}:host:1"
