"""The per-process runtime: settings, one queue (one connection pool), registry, lease keeper.

Built lazily and once per process id, so prefork children never share the parent's
database connections.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from bridge.config import Settings, current_settings
from bridge.engine.lease_keeper import LeaseKeeper
from bridge.engine.metrics import watch_breaker
from bridge.engine.writes import WriteGate
from bridge.handlers.registry import Registry, build_registry
from bridge.queue import PhorgeQueue


@dataclass
class Runtime:
    settings: Settings
    queue: PhorgeQueue
    registry: Registry
    keeper: LeaseKeeper = field(init=False)
    writes: WriteGate = field(init=False)

    def __post_init__(self) -> None:
        self.keeper = LeaseKeeper(self.queue)
        self.writes = WriteGate(self.queue.probe_writes)


def build_runtime(settings: Settings) -> Runtime:
    queue = PhorgeQueue.from_url(settings.database_url, settings.report_attempts)
    if queue.engine.dialect.name == "sqlite":
        # The embedded default starts from nothing; Phorge's MySQL tables are Phorge's.
        queue.create_tables()
    registry = build_registry(settings)
    for handler in registry.handlers():
        if handler.breaker is not None:
            watch_breaker(handler.breaker)
    return Runtime(settings, queue, registry)


_runtimes: dict[int, Runtime] = {}


def runtime() -> Runtime:
    """This process's runtime (a fresh one in each forked child)."""
    pid = os.getpid()
    if pid not in _runtimes:
        for inherited in _runtimes.values():
            # Forget the parent's pooled connections without closing them: closing would
            # end the parent's sessions on the sockets this child shares.
            inherited.queue.engine.dispose(close=False)
        _runtimes.clear()
        _runtimes[pid] = build_runtime(current_settings())
    return _runtimes[pid]
