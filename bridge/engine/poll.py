"""One poll of Phorge's queue: lease due rows per Celery queue, up to its free capacity.

Each queue leases only up to its own free capacity (``max_inflight`` minus the leases
the bridge holds for its classes), so a flood in one queue never starves another. One
poll runs at a time (a database lock; an overlapping poll returns at once), so two
polls never both fill the same capacity. A full dispatch marks its middle message: when
that message has run, half the capacity is free and the worker asks for a poll at once,
so throughput is not capped at ``max_inflight / poll_interval``.

Sending is the caller's (:class:`Send`): the Celery runtime publishes messages, the
benchmark's SQL loop runs them in process. While the database refuses writes the lease
is refused too: the write gate closes (logged once), and each poll then only probes
until writes are accepted again, so the gate of an idle worker reopens too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

from bridge.engine.context import Runtime
from bridge.handlers.api import Handler
from bridge.queue.model import Leased
from bridge.queue.retry import WritesRefused

SPREAD = 32


class Send(Protocol):
    def __call__(
        self, owner: str, tasks: Sequence[Leased], queue: str, size: int, mark: bool = False
    ) -> int:
        """Send ``tasks`` (leased by ``owner``) to ``queue``, ``size`` a message; returns
        how many were sent before any error. ``mark`` asks the middle message to poll
        once run."""
        ...


def batch_size(in_flight: int, batch_max: int) -> int:
    """Tasks a message carries for a queue holding ``in_flight`` leases (this dispatch's
    included): one each below ``2 * SPREAD``, else enough to make ``SPREAD`` messages of
    them, at most ``batch_max``.

    A message costs the worker about as much CPU as a short task's own work, so a
    backlog shares it; a light load keeps one message per Phorge task (Flower shows
    each one's state), and a queue at its capacity holds about ``SPREAD`` messages
    whatever the poll interval, so up to that many processes or threads are busy.
    """
    return max(1, min(batch_max, in_flight // SPREAD))


def plan(rt: Runtime) -> dict[str, list[str]]:
    """Runnable task classes present in the queue, grouped by the Celery queue serving them.

    A class is left out while its handler is not :meth:`~Handler.available` (the Conduit
    proxy while its circuit breaker is open), asked once per handler and poll.
    """
    by_queue: dict[str, list[str]] = defaultdict(list)
    available: dict[int, bool] = {}
    for task_class in rt.registry.runnable(rt.queue.task_classes()):
        handler: Handler | None = rt.registry.handler_for(task_class)
        assert handler is not None
        key = id(handler)
        if key not in available:
            available[key] = handler.available()
        if available[key]:
            by_queue[rt.settings.router.queue_for(task_class)].append(task_class)
    return by_queue


def poll_once(rt: Runtime, send: Send) -> int:
    """One poll; returns how many tasks were dispatched (0 when another poll is running)."""
    settings = rt.settings
    with rt.queue.poll_lock(settings.owner_prefix) as now:
        if now is None:
            return 0
        if not rt.writes.is_open and not rt.writes.wait_open(0):
            return 0  # one probe a poll while writes are refused: nothing to lease
        by_queue = plan(rt)
        # An idle queue (the usual case between bursts) skips the capacity count.
        held = rt.queue.held_by_class(settings.owner_prefix) if by_queue else {}
        sent = 0
        for queue, classes in by_queue.items():
            limit = settings.max_inflight.for_queue(queue)
            in_flight = sum(held.get(c, 0) for c in classes)
            capacity = limit - in_flight
            if capacity <= 0:
                continue
            try:
                owner, tasks = rt.queue.lease_to_send(
                    capacity,
                    settings.owner_prefix,
                    settings.dispatch_lease,
                    classes,
                    settings.inline_data_max,
                    now=now,
                )
            except WritesRefused as exc:
                rt.writes.refused(exc)  # logged once; each poll probes until it ends
                return sent
            size = batch_size(in_flight + len(tasks), settings.batch_max)
            done = send(owner, tasks, queue, size, mark=len(tasks) >= max(1, limit // 2))
            if done < len(tasks):
                # The broker refused: hand the unsent leases back at once rather than
                # letting them wait out the dispatch lease.
                rt.queue.free_own([t.id for t in tasks[done:]], owner)
            sent += done
        return sent
