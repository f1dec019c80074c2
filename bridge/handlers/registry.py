"""The handler registry: which handler runs a task class, or None (leave it to PHP).

Native handlers come from the ``phorge_bridge.handlers`` entry-point group, so other
packages can ship theirs; every other class goes to the Conduit proxy once it is
configured. Include/exclude globs narrow both.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from fnmatch import fnmatchcase
from importlib.metadata import entry_points

from bridge.handlers.base import Handler

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "phorge_bridge.handlers"


def discover() -> list[Handler]:
    """Instantiate every handler class published in the entry-point group."""
    handlers = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        handler_class = entry.load()
        handlers.append(handler_class())
        log.debug("handler %s from %s", entry.name, entry.value)
    return handlers


class Registry:
    """Maps a task class to the handler that serves it."""

    def __init__(
        self,
        handlers: Iterable[Handler],
        *,
        fallback: Handler | None = None,
        include: Iterable[str] = ("*",),
        exclude: Iterable[str] = (),
    ) -> None:
        self.native: dict[str, Handler] = {}
        for handler in handlers:
            for task_class in handler.task_classes:
                self.native[task_class] = handler
        self.fallback = fallback
        self.include = tuple(include)
        self.exclude = tuple(exclude)

    def allowed(self, task_class: str) -> bool:
        return any(fnmatchcase(task_class, g) for g in self.include) and not any(
            fnmatchcase(task_class, g) for g in self.exclude
        )

    def handler_for(self, task_class: str) -> Handler | None:
        """The handler for a class, or None when the bridge must not run it."""
        if not self.allowed(task_class):
            return None
        return self.native.get(task_class, self.fallback)

    def runnable(self, task_classes: Iterable[str]) -> list[str]:
        return [c for c in task_classes if self.handler_for(c) is not None]
