"""Puts a process's runtime together: its queue, and the handlers its settings call for.

The engine runs whatever registry it is given and imports no transport; this module
chooses them. Native handlers come from the ``phorge_bridge.handlers`` entry-point group,
so other packages can ship theirs; every other class goes to the PHP runner when
``BRIDGE_PHORGE_ROOT`` is set and the class matches ``BRIDGE_RUNNER_CLASSES``, else to
the Conduit proxy once it is configured. An entry point names one of:

- a :class:`Handler` subclass, instantiated without arguments;
- a :class:`Handler` instance, such as a function decorated with ``@handler``;
- a factory ``factory(settings: Settings, conduit: ConduitClient | None)`` returning a
  Handler or an iterable of them: it gets what the built-in handlers get, the settings
  and the Conduit client (None when ``BRIDGE_CONDUIT_URL`` is not set).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points

from bridge.canary.store import CanaryView
from bridge.canary.weights import OPTION, SCALE, Canary, percent
from bridge.config import Settings, current_settings
from bridge.engine.context import Runtime, open_runtime
from bridge.errors import BridgeError, ConfigError
from bridge.handlers.api import Handler
from bridge.handlers.registry import Registry
from bridge.metrics import count_runs
from bridge.queue.implementations import PYTHON
from bridge.transports.conduit import metrics as conduit_metrics
from bridge.transports.conduit.client import ConduitClient
from bridge.transports.conduit.feed import FeedPublisherHTTPHandler
from bridge.transports.conduit.handler import ConduitProxyHandler
from bridge.transports.conduit.request_slots import RequestSlots
from bridge.transports.php_runner import metrics as runner_metrics
from bridge.transports.php_runner.handler import PhpRunnerHandler
from bridge.transports.php_runner.pool import RunnerPool

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "phorge_bridge.handlers"

HandlerFactory = Callable[[Settings, ConduitClient | None], Handler | Iterable[Handler]]


def instantiate(
    published: object, settings: Settings, conduit: ConduitClient | None
) -> list[Handler]:
    """The handlers an entry point's object stands for (see the module's docstring)."""
    if isinstance(published, Handler):
        made: object = published
    elif isinstance(published, type) and issubclass(published, Handler):
        made = published()
    elif callable(published):
        made = published(settings, conduit)
    else:
        raise BridgeError(f"{published!r} is not a Handler, a Handler subclass or a factory")
    handlers: list[Handler] = []
    for item in list(made) if isinstance(made, Iterable) else [made]:
        if not isinstance(item, Handler):
            raise BridgeError(f"{published!r} made {item!r}, which is not a Handler")
        handlers.append(item)
    return handlers


def discover(settings: Settings, conduit: ConduitClient | None) -> list[Handler]:
    """Every handler published in the entry-point group."""
    handlers = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        handlers += instantiate(entry.load(), settings, conduit)
        log.debug("handlers of %s from %s", entry.name, entry.value)
    return handlers


def build_registry(settings: Settings) -> Registry:
    """The registry this process serves with: published handlers; the PHP runner when a
    Phorge checkout is set; once Conduit is configured, the native feed hook and the
    proxy for every other class (without either, those classes stay queued for PHP)."""
    reach = settings.conduit
    conduit = ConduitClient.from_settings(reach) if reach is not None else None
    handlers = discover(settings, conduit)
    fallback = None
    if reach is not None and conduit is not None:
        handlers.append(FeedPublisherHTTPHandler(conduit))
        slots = RequestSlots(reach.max_requests)
        fallback = ConduitProxyHandler(conduit, batch=reach.batch, slots=slots)
        conduit_metrics.watch(fallback.availability)
    runner = None
    if settings.runner is not None:
        runner = PhpRunnerHandler(
            RunnerPool(settings.runner), settings.runner.classes, settings.default_lease
        )
        runner_metrics.watch(runner)
    return Registry(
        handlers,
        runner=runner,
        runner_classes=settings.runner.classes if settings.runner is not None else (),
        fallback=fallback,
        include=settings.handlers_include,
        exclude=settings.handlers_exclude,
    )


def build_runtime(settings: Settings) -> Runtime:
    """A runtime for ``settings``: the engine's, with the handlers they call for and its
    runs counted in the metrics."""
    count_runs()
    return open_runtime(settings, build_registry(settings))


def unhonoured(canary: Canary, registry: Registry) -> list[str]:
    """What of ``canary`` a worker serving ``registry`` cannot honour, one line per class:
    a python weight below 100 for a class it serves natively but has no PHP path for (no
    runner glob matches it, no Conduit): the old side's share would have nowhere to run."""
    problems = []
    for task_class, handler in registry.native.items():
        weight = canary.weight(task_class, PYTHON)
        if weight >= SCALE or registry.handler_for(task_class) is not handler:
            continue
        if registry.php_handler_for(task_class) is None:
            problems.append(
                f"{task_class}: python weight {percent(weight):g}% needs a PHP path for the "
                "class in this worker (a BRIDGE_RUNNER_CLASSES glob with BRIDGE_PHORGE_ROOT, "
                "or BRIDGE_CONDUIT_URL), and it has none"
            )
    return problems


def check_canary(rt: Runtime) -> Canary:
    """The weights a worker starts with, read fresh: raises ConfigError naming
    ``phorge-bridge.canary`` for weights that are not valid, or that this worker cannot
    honour (:func:`unhonoured`). Later, bad values are logged and the last good ones kept
    (``CanaryView``)."""
    canary = rt.canary.store.read() if isinstance(rt.canary, CanaryView) else rt.canary.current()
    problems = unhonoured(canary, rt.registry)
    if problems:
        raise ConfigError(OPTION, "; ".join(problems))
    return canary


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
