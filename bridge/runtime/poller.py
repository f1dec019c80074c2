"""``bridge.poll``: lease due rows per Celery queue and dispatch them to Celery.

Each queue leases only up to its own free capacity (``max_inflight`` minus the leases
the bridge holds for its classes), so a flood in one queue never starves another. One
poll runs at a time (a database lock; an overlapping poll returns at once), so two
polls never both fill the same capacity. A full dispatch marks its middle message: when
that message has run, half the capacity is free and the worker asks for a poll at once, so
throughput is not capped at ``max_inflight / poll_interval``.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict

from bridge.celery import app
from bridge.handlers.conduit_proxy import ConduitProxyHandler
from bridge.queue.model import Leased, new_owner
from bridge.queue.retry import DatabaseUnavailable, is_transient
from bridge.runtime.consumers import ConsumerWatch, survey
from bridge.runtime.context import Runtime, runtime
from bridge.runtime.dispatch import batch_size, send

log = logging.getLogger(__name__)


def plan(rt: Runtime) -> dict[str, list[str]]:
    """Runnable task classes present in the queue, grouped by the Celery queue serving them.

    Proxied classes are left out while Conduit's circuit breaker is open. This process may
    never run a proxied task itself, so the breaker is verified here (a probe at most
    every few seconds), not merely read.
    """
    by_queue: dict[str, list[str]] = defaultdict(list)
    conduit_up: bool | None = None
    for task_class in rt.registry.runnable(rt.queue.task_classes()):
        handler = rt.registry.handler_for(task_class)
        if isinstance(handler, ConduitProxyHandler):
            if conduit_up is None:
                conduit_up = handler.breaker.verify()
            if not conduit_up:
                continue
        by_queue[rt.settings.router.queue_for(task_class)].append(task_class)
    return by_queue


def dispatch(
    rt: Runtime, tasks: list[Leased], owner: str, queue: str, limit: int, held: int
) -> int:
    """Send leased rows to their queue (which held ``held`` leases before them); returns
    how many were sent before any error.

    A dispatch that took at least half the capacity marks its middle message to ask for
    the next poll once it has run."""
    size = batch_size(held + len(tasks), rt.settings.batch_max)
    return send(owner, tasks, queue, size, mark=len(tasks) >= max(1, limit // 2))


def poll_once(rt: Runtime) -> int:
    """One poll; returns how many tasks were dispatched (0 when another poll is running)."""
    settings = rt.settings
    with rt.queue.poll_lock(settings.owner_prefix) as now:
        if now is None:
            return 0
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
            # The owner's epoch is the database's clock, as failureTime is.
            owner = new_owner(settings.owner_prefix, now)
            tasks = rt.queue.lease_to_send(
                capacity, owner, settings.dispatch_lease, classes, settings.inline_data_max
            )
            done = dispatch(rt, tasks, owner, queue, limit, in_flight)
            if done < len(tasks):
                # The broker refused: hand the unsent leases back at once rather than
                # letting them wait out the dispatch lease.
                rt.queue.free_own([t.id for t in tasks[done:]], owner)
            sent += done
        return sent


_watches: dict[int, ConsumerWatch] = {}


def watch_consumers(rt: Runtime) -> None:
    """Log queues left with due rows and no consumer, once per change (per process).

    The control API is asked at most every ``ConsumerWatch.every`` seconds, on a thread
    of its own: the poll goes on at once, and a failure to ask never fails it.
    """
    pid = os.getpid()
    if pid not in _watches:
        _watches.clear()
        _watches[pid] = ConsumerWatch(
            lambda: survey(app, rt.queue.stats(), rt.registry, rt.settings), log_changes=True
        )
    _watches[pid].refresh_soon()


@app.task(name="bridge.poll", acks_late=False, ignore_result=True)
def poll() -> int:
    """Beat's periodic poll of Phorge's queue (and the one a marked task asks for)."""
    try:
        sent = poll_once(runtime())
        watch_consumers(runtime())
    except Exception as exc:
        if not (isinstance(exc, DatabaseUnavailable) or is_transient(exc)):
            raise
        # The next poll tries again; one line, not a traceback per second.
        log.warning("poll skipped: database unavailable: %s", exc)
        return 0
    if sent:
        log.info("dispatched %d task(s)", sent)
    return sent
