"""A process's runtime: settings, one queue (one connection pool), registry, lease keeper.

``bridge.assembly`` builds one lazily and once per process id, so prefork children never
share the parent's database connections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bridge.config import Settings
from bridge.engine.lease_keeper import LeaseKeeper
from bridge.engine.writes import WriteGate
from bridge.handlers.registry import Registry
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


def open_runtime(settings: Settings, registry: Registry) -> Runtime:
    """A runtime serving ``registry`` on the queue ``settings`` name (``bridge.assembly``
    builds the registry from the settings)."""
    queue = PhorgeQueue.from_url(settings.database_url, settings.report_attempts)
    if queue.engine.dialect.name == "sqlite":
        # The embedded default starts from nothing; Phorge's MySQL tables are Phorge's.
        queue.create_tables()
    return Runtime(settings, queue, registry)
