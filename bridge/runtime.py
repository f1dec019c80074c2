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


def conduit_proxy(settings: Settings) -> Handler | None:
    """The handler for PHP-only classes, when Conduit is configured."""
    if not settings.conduit_enabled:
        return None
    from bridge.conduit import ConduitClient, ConduitSettings
    from bridge.handlers.conduit_proxy import ConduitProxyHandler

    client = ConduitClient.from_settings(
        ConduitSettings(
            url=settings.conduit_url,
            token=settings.conduit_token,
            connect_timeout=settings.conduit_connect_timeout,
            read_timeout=settings.conduit_read_timeout,
            verify_tls=settings.conduit_verify_tls,
        )
    )
    return ConduitProxyHandler(client)


def build_runtime(settings: Settings) -> Runtime:
    registry = Registry(
        discover(),
        fallback=conduit_proxy(settings),
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
        _runtimes.clear()
        _runtimes[pid] = build_runtime(current_settings())
    return _runtimes[pid]
