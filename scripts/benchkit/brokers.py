"""The brokers besides RabbitMQ (``rabbit``) that issue 21's scenarios run the bridge on.

- SQLite, the bridge's default (kombu's SQLAlchemy transport): a new file for every
  consumer start, so no message of a stopped run is ever delivered to the next one.
- Redis: a private ``redis-server`` of the bench on a port of its own, without
  persistence, its state in the bench's temporary directory and gone with it; the
  tests' Redis of ``scripts/services.sh`` is never touched. Only if it is installed.

Every bridge start of these scenarios gets queue names of its own as well
(``consumers.bridge_settings``): a run stops with messages still queued.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchkit import procs
from benchkit.rabbit import Broker

STARTUP_TIMEOUT = 30


def sqlite(scratch: Path) -> Broker:
    """A broker file of its own in a new directory of ``scratch``."""
    directory = Path(tempfile.mkdtemp(prefix="sqlite-broker-", dir=scratch))
    return Broker(f"sqla+sqlite:///{directory / 'broker.db'}", None)


def redis_installed() -> bool:
    return shutil.which("redis-server") is not None


def _pong(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


@contextmanager
def private_redis(port: int, scratch: Path) -> Iterator[Broker]:
    """``redis-server`` on 127.0.0.1:``port``, in memory only; stopped afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="redis-", dir=scratch))
    command = [
        "redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
        "--appendonly", "no", "--dir", str(directory),
    ]  # fmt: skip
    proc = procs.start("redis", command, env=dict(os.environ), cwd=directory, log=directory / "log")
    try:
        procs.wait_until(
            lambda: _pong(port),
            timeout=STARTUP_TIMEOUT,
            what=f"the bench's Redis on port {port}",
            check=lambda: _alive(proc),
        )
        yield Broker(f"redis://127.0.0.1:{port}/0", None)
    finally:
        procs.stop(proc)


def _alive(proc: procs.Proc) -> None:
    if not proc.alive():
        raise procs.BenchError(f"redis-server exited:\n{proc.tail()}")
