"""The handler registry: which handler runs a task class, or None (leave it to PHP).

Native handlers come from the ``phorge_bridge.handlers`` entry-point group, so other
packages can ship theirs; every other class goes to the PHP runner when
``BRIDGE_PHORGE_ROOT`` is set and the class matches ``BRIDGE_RUNNER_CLASSES``, else to
the Conduit proxy once it is configured. Include/exclude globs narrow them all.

An entry point names one of:

- a :class:`Handler` subclass, instantiated without arguments;
- a :class:`Handler` instance, such as a function decorated with ``@handler``;
- a factory ``factory(settings: Settings, conduit: ConduitClient | None)`` returning a
  Handler or an iterable of them: it gets what the built-in handlers get, the settings
  and the Conduit client (None when ``BRIDGE_CONDUIT_URL`` is not set).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase
from importlib.metadata import entry_points

from bridge.config import Settings
from bridge.errors import BridgeError, DuplicateHandlerError
from bridge.handlers.api import Handler
from bridge.handlers.conduit_proxy import ConduitProxyHandler
from bridge.handlers.feed import FeedPublisherHTTPHandler
from bridge.handlers.php_runner import PhpRunnerHandler
from bridge.phorge.conduit import ConduitClient
from bridge.phorge.request_slots import RequestSlots
from bridge.phorge.runner_pool import RunnerPool

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


class Registry:
    """Maps a task class to the handler that serves it; one handler per class."""

    def __init__(
        self,
        handlers: Iterable[Handler],
        *,
        runner: PhpRunnerHandler | None = None,
        fallback: Handler | None = None,
        include: Iterable[str] = ("*",),
        exclude: Iterable[str] = (),
    ) -> None:
        self.native: dict[str, Handler] = {}
        for handler in handlers:
            for task_class in handler.task_classes:
                claimed = self.native.setdefault(task_class, handler)
                if claimed is not handler:
                    raise DuplicateHandlerError(
                        f"{task_class} is claimed by two handlers: {claimed.name} and "
                        f"{handler.name}; uninstall one, or publish only one of them"
                    )
        self.runner = runner
        self.fallback = fallback
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self._served: dict[str, Handler | None] = {}  # handler_for's answers, per class

    def allowed(self, task_class: str) -> bool:
        return any(fnmatchcase(task_class, g) for g in self.include) and not any(
            fnmatchcase(task_class, g) for g in self.exclude
        )

    def handler_for(self, task_class: str) -> Handler | None:
        """The handler for a class, or None when the bridge must not run it (matched
        against the patterns once per class: every task asks)."""
        try:
            return self._served[task_class]
        except KeyError:
            handler = self.native.get(task_class)
            if handler is None:
                runs_here = self.runner is not None and self.runner.serves(task_class)
                handler = self.runner if runs_here else self.fallback
            served = handler if self.allowed(task_class) else None
            return self._served.setdefault(task_class, served)

    def handlers(self) -> list[Handler]:
        """Every handler that may serve a class, each once (the runner, then the fallback,
        last)."""
        found = list({id(h): h for h in self.native.values()}.values())
        return found + [h for h in (self.runner, self.fallback) if h is not None]

    def runnable(self, task_classes: Iterable[str]) -> list[str]:
        return [c for c in task_classes if self.handler_for(c) is not None]


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
    runner = None
    if settings.runner is not None:
        pool = RunnerPool(settings.runner)
        runner = PhpRunnerHandler(pool, settings.runner.classes, settings.default_lease)
    return Registry(
        handlers,
        runner=runner,
        fallback=fallback,
        include=settings.handlers_include,
        exclude=settings.handlers_exclude,
    )
