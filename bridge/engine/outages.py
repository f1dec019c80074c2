"""Which transports are down in this process, until when, and what its worker announces.

A worker whose transport is down (its PHP runner cannot boot, Conduit is unavailable)
hands back each leased task of it at once (``run.prepare``). That alone is not enough:
a worker that hands back at once is always ready for the next message, so it would take
most of a shared queue's messages and leave the healthy workers starved (issue 31: 0.01x
of the healthy rate). So it tells its worker, which announces the transport down to the
fleet's polls and stops consuming a queue it can run nothing of until the transport is
due to probe again (``bridge.runtime.standby`` does the telling and the stopping), and
the polls lease that queue's rows for the other workers (``poll.plan``).

A worker that cannot read the canary's weights hands back each task of a class they
share with phd (phd's share, ``sides.choose``), and would starve the others alike; it
stands by the same way, on a queue all of whose classes it hands back so, until it is
due to read the weights again (:meth:`Outages.report_unread`), and announces nothing.

:class:`Outages` is that state, one per process (``Runtime.outages``): who is down (the
registry's availabilities), until when this task process last told its worker, and, in
the worker's main process, what it announces and the queues it stands by on.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from bridge.canary.weights import Canary
from bridge.handlers.capabilities import availability_of
from bridge.handlers.registry import Registry
from bridge.queue.implementations import CELERY
from bridge.routing import Router

# Shortest standby: a probe that is due at once still leaves the queue to the others for
# this long, so a message bounced between two broken workers costs little.
MIN_STANDBY = 1.0
UNREAD = ""  # the standby of a worker that cannot read the weights: no transport is down


class Resume(Protocol):
    """What resumes consuming a queue on standby (a timer entry of the worker's consumer)."""

    def cancel(self) -> None: ...


@dataclass(frozen=True)
class Report:
    """What a task process tells its worker: ``transport`` is down here for ``seconds``
    (:data:`UNREAD`: none is, the weights are unread); with ``stop``, the process can run
    nothing of ``queue`` that long."""

    queue: str
    seconds: float
    transport: str
    stop: bool


class Outages:
    """A process's transports that are down, and what it said and heard of them."""

    def __init__(self, registry: Registry, router: Router) -> None:
        self._registry = registry
        self._router = router
        self._lock = threading.Lock()
        self._reported: dict[tuple[str, str], float] = {}  # (transport, queue) -> report's end
        self._announced: dict[str, float] = {}  # transport -> end of its announcement
        # Main process: the queues it stopped consuming on purpose, and what resumes each.
        self.standing_by: dict[str, Resume] = {}

    def standby_queues(self, present: Iterable[str]) -> dict[str, float]:
        """The Celery queues of ``present`` (the active table's classes) this process can
        run none of now, each with the seconds until the first of their down transports
        probes again. A queue with a class it can run (a native handler's, or one whose
        transport is up) is not one: there it hands back only the tasks it cannot run."""
        runs: set[str] = set()
        down: dict[str, list[float]] = defaultdict(list)
        for task_class in present:
            handler = self._registry.handler_for(task_class)
            if handler is None:
                continue
            queue = self._router.queue_for(task_class)
            availability = availability_of(handler)
            if availability is None or not availability.is_down:
                runs.add(queue)
            else:
                down[queue].append(availability.next_probe_in())
        return {q: max(MIN_STANDBY, min(waits)) for q, waits in down.items() if q not in runs}

    def report(self, task_class: str, present: Callable[[], Iterable[str]]) -> Report | None:
        """What this task process tells its worker after handing back a task of
        ``task_class`` (``present`` reads the active table's classes); None when its
        transport is up (the hand-back was no transport's: phd's share, a new side's
        failure) or its last report for the class's queue still holds."""
        registry = self._registry
        transport = registry.coverage().transport_for(task_class)
        handler = registry.handler_for(task_class)
        availability = availability_of(handler) if handler is not None else None
        if transport is None or availability is None or not availability.is_down:
            return None
        queue = self._router.queue_for(task_class)
        with self._lock:
            if self._still_holds(transport, queue):
                return None
            stop = self.standby_queues(present()).get(queue)
            seconds = stop or max(MIN_STANDBY, availability.next_probe_in())
            self._reported[transport, queue] = time.monotonic() + seconds
        return Report(queue, seconds, transport, stop is not None)

    def report_unread(
        self, task_class: str, present: Callable[[], Iterable[str]], canary: Canary, seconds: float
    ) -> Report | None:
        """What this task process tells its worker after handing back a task of
        ``task_class`` as phd's share while it cannot read the weights (``canary``, the
        closed ones it runs meanwhile, ``canary.unread``): that it can run nothing of the
        class's queue until it reads them again, ``seconds`` from now, when it hands back
        every class queued there (its celery weight is 0 here); else None."""
        if not canary.unread:
            return None
        queue = self._router.queue_for(task_class)
        with self._lock:
            if self._still_holds(UNREAD, queue):
                return None
            queued = [c for c in present() if self._router.queue_for(c) == queue]
            if any(canary.weight(c, CELERY) for c in queued if self._registry.handler_for(c)):
                return None
            seconds = max(MIN_STANDBY, seconds)
            self._reported[UNREAD, queue] = time.monotonic() + seconds
        return Report(queue, seconds, UNREAD, True)

    def _still_holds(self, transport: str, queue: str) -> bool:
        """Whether this process's last report of ``transport`` for ``queue`` still holds."""
        return time.monotonic() < self._reported.get((transport, queue), 0.0)

    def heard(self, transport: str, seconds: float) -> None:
        """A task process of this worker found ``transport`` down, until its next probe:
        the worker announces it down that long."""
        with self._lock:
            until = max(self._announced.get(transport, 0.0), time.monotonic() + seconds)
            self._announced[transport] = until

    def announced_down(self) -> list[str]:
        """The transports this worker announces as down now (``bridge_serves``)."""
        now = time.monotonic()
        with self._lock:
            return sorted(t for t, until in self._announced.items() if until > now)
