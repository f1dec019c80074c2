"""The per-process runtime: settings, one queue (one connection pool) and the registry.

Built lazily and once per process id, so prefork children never share the parent's
database connections.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from bridge.config import Settings, current_settings
from bridge.handlers.base import Handler
from bridge.handlers.registry import Registry, discover
from bridge.queue import PhorgeQueue


@dataclass
class Runtime:
    settings: Settings
    queue: PhorgeQueue
    registry: Registry


def conduit_handlers(settings: Settings) -> tuple[list[Handler], Handler | None]:
    """Handlers that need Phorge's Conduit API: the feed hook and the catch-all proxy.

    Without Conduit there are none, so those classes stay queued for PHP.
    """
    if settings.conduit is None:
        return [], None
    from bridge.conduit import ConduitClient
    from bridge.handlers.conduit_proxy import ConduitProxyHandler
    from bridge.handlers.feed import FeedPublisherHTTPHandler

    client = ConduitClient.from_settings(settings.conduit)
    return [FeedPublisherHTTPHandler(client)], ConduitProxyHandler(client)


def build_runtime(settings: Settings) -> Runtime:
    native, proxy = conduit_handlers(settings)
    registry = Registry(
        [*discover(), *native],
        fallback=proxy,
        include=settings.handlers_include,
        exclude=settings.handlers_exclude,
    )
    queue = PhorgeQueue.from_url(settings.database_url)
    if queue.engine.dialect.name == "sqlite":
        # The embedded default starts from nothing; Phorge's MySQL tables are Phorge's.
        queue.create_tables()
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
