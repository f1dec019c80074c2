"""What a transport adds to the handler API: an availability, and several tasks at once.

Users implement :class:`~bridge.handlers.api.Handler`. A handler whose work runs
somewhere that can be down (the PHP runner's processes, Conduit) or whose tasks are
cheap next to a fixed price (a request, a durable commit) is a :class:`TransportHandler`
too; one that takes several tasks in one call is a :class:`BatchHandler`. The engine
asks these questions through the functions below, of every handler alike.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

from bridge.handlers.api import Handler, TaskContext
from bridge.handlers.availability import Availability
from bridge.queue.implementations import NATIVE


class TransportHandler(Handler):
    """A handler with a transport's capabilities."""

    # What runs the work: Python here (``native``), PHP in the runner (``runner``) or
    # PHP behind Conduit (``conduit``).
    implementation: str = NATIVE

    # Whether the place the work runs can take it now: while it is down, the handler's
    # tasks are handed back and its classes left to workers whose transport is up.
    availability: Availability | None = None
    # How many consecutive tasks of a message may have their outcomes written in one
    # commit (and, for a BatchHandler, run in one call).
    batch_limit: int = 1

    def start(self, slots: int) -> None:
        """The worker process starts, with ``slots`` tasks at once: get ready (the PHP
        runner boots its processes, so no first task waits for a boot)."""

    def stop(self) -> None:
        """The worker process stops: release what :meth:`start` made."""


class BatchHandler(TransportHandler):
    """A transport handler that runs up to ``batch_limit`` checked tasks in one call."""

    @abstractmethod
    def run_batch(self, tasks: Sequence[TaskContext]) -> list[Exception | None]:
        """Run ``tasks`` in order; returns, for each, None (success) or what its ``run``
        would have raised."""


def run_each(handler: Handler, tasks: Sequence[TaskContext]) -> list[Exception | None]:
    """``run_batch`` done one task at a time, for a batch the transport cannot take whole."""
    ended: list[Exception | None] = []
    for task in tasks:
        try:
            handler.run(task)
            ended.append(None)
        except Exception as exc:
            ended.append(exc)
    return ended


def availability_of(handler: Handler) -> Availability | None:
    return handler.availability if isinstance(handler, TransportHandler) else None


def implementation_of(handler: Handler) -> str:
    """:data:`NATIVE`, :data:`RUNNER` or :data:`CONDUIT`: what runs ``handler``'s work
    (every handler that is not a transport's is native, the feed hook included)."""
    return handler.implementation if isinstance(handler, TransportHandler) else NATIVE


def is_available(handler: Handler) -> bool:
    """Whether ``handler`` can take work now, asked once per poll: its availability,
    verified (a probe at most every few seconds), since the process that polls may never
    run such a task itself."""
    availability = availability_of(handler)
    return availability is None or availability.verify()


def batch_limit(handler: Handler) -> int:
    return handler.batch_limit if isinstance(handler, TransportHandler) else 1


def runs_together(handler: Handler) -> bool:
    """Whether a message's consecutive tasks of ``handler`` are checked first, then run in
    one call (the Conduit proxy's one request)."""
    return isinstance(handler, BatchHandler) and handler.batch_limit > 1
