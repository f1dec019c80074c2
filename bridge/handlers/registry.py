"""The handler registry: which handler runs a task class, or None (leave it to PHP).

A class goes to its native handler; every other class to the PHP runner when it matches
the runner's globs, else to the fallback (the Conduit proxy) when there is one.
Include/exclude globs narrow them all. ``bridge.assembly`` fills it from the settings.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from fnmatch import fnmatchcase
from typing import Any

from bridge.errors import DuplicateHandlerError
from bridge.handlers.api import Handler
from bridge.queue.implementations import CONDUIT, NATIVE, RUNNER


def allowed(task_class: str, include: Iterable[str], exclude: Iterable[str]) -> bool:
    return any(fnmatchcase(task_class, g) for g in include) and not any(
        fnmatchcase(task_class, g) for g in exclude
    )


def version_key(transport: str, task_class: str) -> str:
    """Where :meth:`Registry.versions` keeps the version of ``transport`` serving
    ``task_class``: a native handler's per class (``native:Class``), a PHP transport's
    once for all its classes (``runner``, ``conduit``)."""
    return f"{NATIVE}:{task_class}" if transport == NATIVE else transport


@dataclass(frozen=True)
class Coverage:
    """What a registry serves, in a form one worker announces to the others' polls
    (``bridge.runtime.announce``): its native classes, the PHP runner's globs (None
    without a runner), whether the Conduit proxy takes every other class, and the
    include/exclude globs that narrow them all."""

    native: tuple[str, ...] = ()
    runner: tuple[str, ...] | None = None
    conduit: bool = False
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()

    def transport_for(self, task_class: str) -> str | None:
        """:data:`NATIVE`, :data:`RUNNER` or :data:`CONDUIT`: what serves ``task_class``, or
        None when it is left to PHP's taskmasters."""
        if not allowed(task_class, self.include, self.exclude):
            return None
        if task_class in self.native:
            return NATIVE
        return self.php_transport_for(task_class)

    def php_transport_for(self, task_class: str) -> str | None:
        """:data:`RUNNER` or :data:`CONDUIT`: what runs ``task_class`` in PHP here, native
        handler or not (the old side of the python level), or None."""
        if not allowed(task_class, self.include, self.exclude):
            return None
        if self.runner is not None and any(fnmatchcase(task_class, g) for g in self.runner):
            return RUNNER
        return CONDUIT if self.conduit else None

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
                conduit=bool(data["conduit"]),
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
        runner: Handler | None = None,
        runner_classes: tuple[str, ...] = (),
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
        self.runner_classes = runner_classes
        self.fallback = fallback
        self.include = tuple(include)
        self.exclude = tuple(exclude)
        self._served: dict[str, Handler | None] = {}  # handler_for's answers, per class
        self._php: dict[str, Handler | None] = {}  # php_handler_for's

    def allowed(self, task_class: str) -> bool:
        return allowed(task_class, self.include, self.exclude)

    def coverage(self) -> Coverage:
        return Coverage(
            native=tuple(self.native),
            runner=None if self.runner is None else self.runner_classes,
            conduit=self.fallback is not None,
            include=self.include,
            exclude=self.exclude,
        )

    def versions(self) -> dict[str, str]:
        """The version of what serves each class here (:attr:`Handler.version`), keyed as
        :func:`version_key` says: what a worker announces, so that a canary judges
        a new side afresh once what runs it changed."""
        served = [(version_key(NATIVE, c), h) for c, h in self.native.items()]
        served += [(t, h) for t, h in ((RUNNER, self.runner), (CONDUIT, self.fallback)) if h]
        return {key: version for key, h in served if (version := h.version) is not None}

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
                CONDUIT: self.fallback,
            }
            served = None if transport is None else handlers[transport]
            return self._served.setdefault(task_class, served)

    def php_handler_for(self, task_class: str) -> Handler | None:
        """What would serve a class without its native handler: the PHP runner when the
        class matches its globs, else the Conduit proxy, else None (no PHP path here). A
        canary's python level runs the old side's share with it."""
        try:
            return self._php[task_class]
        except KeyError:
            transport = replace(self.coverage(), native=()).transport_for(task_class)
            handler = {RUNNER: self.runner, CONDUIT: self.fallback}.get(transport or "")
            return self._php.setdefault(task_class, handler)

    def handlers(self) -> list[Handler]:
        """Every handler that may serve a class, each once (the runner, then the fallback,
        last)."""
        found = list({id(h): h for h in self.native.values()}.values())
        return found + [h for h in (self.runner, self.fallback) if h is not None]

    def runnable(self, task_classes: Iterable[str]) -> list[str]:
        return [c for c in task_classes if self.handler_for(c) is not None]
