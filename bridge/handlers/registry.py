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
from dataclasses import asdict, dataclass
from fnmatch import fnmatchcase
from importlib.metadata import entry_points
from typing import Any

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


NATIVE, RUNNER, PROXY = "native", "runner", "proxy"  # what may serve a class


def allowed(task_class: str, include: Iterable[str], exclude: Iterable[str]) -> bool:
    return any(fnmatchcase(task_class, g) for g in include) and not any(
        fnmatchcase(task_class, g) for g in exclude
    )


@dataclass(frozen=True)
class Coverage:
    """What a registry serves, in a form one worker announces to the others' polls
    (``bridge.runtime.announce``): its native classes, the PHP runner's globs (None
    without a runner), whether the Conduit proxy takes every other class, and the
    include/exclude globs that narrow them all."""

    native: tuple[str, ...] = ()
    runner: tuple[str, ...] | None = None
    proxy: bool = False
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()

    def transport_for(self, task_class: str) -> str | None:
        """:data:`NATIVE`, :data:`RUNNER` or :data:`PROXY`: what serves ``task_class``, or
        None when it is left to PHP's taskmasters."""
        if not allowed(task_class, self.include, self.exclude):
            return None
        if task_class in self.native:
            return NATIVE
        if self.runner is not None and any(fnmatchcase(task_class, g) for g in self.runner):
            return RUNNER
        return PROXY if self.proxy else None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Coverage:
        """Read another worker's announcement; raises ValueError when it is not one."""
        try:
            runner = data["runner"]
            return cls(
                native=tuple(data["native"]),
                runner=None if runner is None else tuple(runner),
                proxy=bool(data["proxy"]),
                include=tuple(data["include"]),
                exclude=tuple(data["exclude"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a coverage: {data!r}") from exc


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
        return allowed(task_class, self.include, self.exclude)

    def coverage(self) -> Coverage:
        return Coverage(
            native=tuple(self.native),
            runner=None if self.runner is None else self.runner.classes,
            proxy=self.fallback is not None,
            include=self.include,
            exclude=self.exclude,
        )

    def handler_for(self, task_class: str) -> Handler | None:
        """The handler for a class, or None when the bridge must not run it (matched
        against the patterns once per class: every task asks)."""
        try:
            return self._served[task_class]
        except KeyError:
            transport = self.coverage().transport_for(task_class)
            handlers = {
                NATIVE: self.native.get(task_class),
                RUNNER: self.runner,
                PROXY: self.fallback,
            }
            served = None if transport is None else handlers[transport]
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
