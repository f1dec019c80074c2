"""The stand-in Phorge (tests/php_standin/) and what the PHP runner's tests build on it.

php-cli is installed by ``scripts/services.sh install``; when it is missing these tests
fail, never skip.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bridge.config import RunnerSettings
from bridge.handlers.api import TaskContext
from bridge.phorge.php import decode_data, encode_data
from bridge.transports.php_runner.handler import PhpRunnerHandler
from bridge.transports.php_runner.pool import RunnerPool

STANDIN_ROOT = Path(__file__).resolve().parents[1] / "php_standin"
DEFAULT_LEASE = 7200


def php_binary() -> str:
    php = shutil.which("php")
    if php is None:
        pytest.fail("php is not installed (scripts/services.sh install): the runner is untested")
    return php


def runner_settings(root: Path = STANDIN_ROOT, **overrides: Any) -> RunnerSettings:
    settings = RunnerSettings(
        php=php_binary(),
        phorge_root=root,
        classes=("Standin*",),
        max_tasks=10_000,
        max_age=3600.0,
        max_rss=512 * 1024 * 1024,
    )
    return replace(settings, **overrides)


@contextmanager
def runner_handler(
    settings: RunnerSettings | None = None, *, default_lease: int = DEFAULT_LEASE
) -> Iterator[PhpRunnerHandler]:
    """A handler on a pool of its own, closed on the way out."""
    settings = settings or runner_settings()
    handler = PhpRunnerHandler(RunnerPool(settings), settings.classes, default_lease)
    try:
        yield handler
    finally:
        handler.pool.close()


def context(
    task_class: str, data: Any = None, *, failure_count: int = 0, task_id: int = 1
) -> TaskContext:
    raw = encode_data({} if data is None else data)
    decoded, _ = decode_data(raw)
    return TaskContext(
        id=task_id,
        task_class=task_class,
        data=decoded,
        failure_count=failure_count,
        priority=1500,
        raw_data=raw,
        lease_owner="bridge:test",
    )
