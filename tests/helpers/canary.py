"""The canary's weights and state as the tests set and read them: the two rows of
``config_entry`` in the queue's own database (SQLite, and the tests' ``bridge_t_<hex>``
MariaDB databases, where ``BRIDGE_CANARY_DATABASE`` is not needed), written with the
bridge's own store, which task ids each side takes, and which of them
``tests/acceptance/canary_handlers.py`` fails on purpose (that handler's plugin carries a
copy of this module).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine

from bridge.canary.store import CanaryStore
from bridge.canary.weights import SCALE, Canary, CanaryState, bucket

# Weights with every feature, read alike by PHP and Python (tests/unit/
# test_canary_php_parity.py, on PHP alone; tests/phorge/test_queue_daemon.py, on Phorge).
EVERY_FEATURE: dict[str, Any] = {
    "*": {"celery": 0},
    "A": {"celery": 100},
    "B": {"celery": 5},
    "C": {"python": 50},
    "D": {"ramp": {"level": "celery", "steps": [1, 5, 25, 50, 100], "dwell": 600}},
    "E": {"celery": 12.345},
    "F": {"celery": 0.125},  # 12.5 bp: half to even, as Python's round()
    "G": {"celery": 20},
}


def store(engine: Engine) -> CanaryStore:
    """The store of the options in ``engine``'s own database."""
    return CanaryStore(engine, None)


def set_weights(engine: Engine, weights: dict[str, Any]) -> None:
    """Set ``phorge-bridge.canary`` as ``bin/config set --database`` would."""
    store(engine).set_weights(weights)


def read(engine: Engine) -> Canary:
    return store(engine).read()


def forget_state(engine: Engine) -> None:
    """No rollback, no ramp step: the state as it was before the bridge wrote any."""
    store(engine).change_state(lambda _state: CanaryState())


def roll_back(engine: Engine, task_class: str, level: str, at: int = 0) -> None:
    store(engine).change_state(
        lambda state: state.with_rollback(task_class, level, at, "rolled back by a test")
    )


def rolled_back(engine: Engine, task_class: str, level: str) -> bool:
    return read(engine).state.of(task_class, level).rolled_back


def new_side(level: str, percent: float, ids: Iterable[int]) -> set[int]:
    """Of ``ids`` (rows that never failed), those the new side of ``level`` takes at
    ``percent``."""
    weight = round(percent * SCALE / 100)
    return {task_id for task_id in ids if bucket(level, task_id) < weight}


def fails_on_purpose(task_id: int, percent: int) -> bool:
    """Whether the test handler set to fail ``percent`` percent of its tasks fails this
    one: a hash of the id, independent of the canary's."""
    return zlib.crc32(f"fail:{task_id}".encode()) % 100 < percent
