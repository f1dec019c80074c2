"""A process's runtime: settings, one queue (one connection pool), registry, lease keeper,
run locks, its transports' outages, and the canary's weights as this process
sees them.

``bridge.assembly`` builds one lazily and once per process id, so prefork children never
share the parent's database connections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from bridge.canary.store import CanaryStore, CanaryView
from bridge.canary.weights import NO_CANARY, Canary
from bridge.config import Settings
from bridge.engine.lease_keeper import LeaseKeeper
from bridge.engine.outages import Outages
from bridge.engine.writes import WriteGate
from bridge.handlers.registry import Registry
from bridge.queue import PhorgeQueue
from bridge.queue.run_locks import RunLocks


class CanarySource(Protocol):
    """What a runtime asks for the weights in force (a :class:`CanaryView`)."""

    def current(self) -> Canary: ...


@dataclass(frozen=True)
class FixedCanary:
    """Weights that never change: none (every class wholly the bridge's and its native
    handlers', today's behaviour) unless given; for runtimes built without a store."""

    canary: Canary = NO_CANARY

    def current(self) -> Canary:
        return self.canary


@dataclass
class Runtime:
    settings: Settings
    queue: PhorgeQueue
    registry: Registry
    canary: CanarySource = field(default_factory=FixedCanary)
    keeper: LeaseKeeper = field(init=False)
    runs: RunLocks = field(init=False)
    writes: WriteGate = field(init=False)
    outages: Outages = field(init=False)

    def __post_init__(self) -> None:
        self.keeper = LeaseKeeper(self.queue)
        self.runs = RunLocks(self.queue.engine, self.settings.report_attempts)
        self.writes = WriteGate(self.queue.probe_writes)
        self.outages = Outages(self.registry, self.settings.router)


def open_runtime(settings: Settings, registry: Registry) -> Runtime:
    """A runtime serving ``registry`` on the queue ``settings`` name (``bridge.assembly``
    builds the registry from the settings), with the canary weights of Phorge's config
    table beside it, read at most every ``BRIDGE_CANARY_REFRESH`` seconds."""
    queue = PhorgeQueue.from_url(settings.database_url, settings.report_attempts)
    if queue.engine.dialect.name == "sqlite":
        # The embedded default starts from nothing; Phorge's MySQL tables are Phorge's.
        queue.create_tables()
    if not settings.canary:
        return Runtime(settings, queue, registry)  # BRIDGE_CANARY=false: no canary at all
    view = CanaryView(CanaryStore.for_settings(queue.engine, settings), settings.canary_refresh)
    return Runtime(settings, queue, registry, view)
