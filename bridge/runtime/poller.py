"""``bridge.poll``: lease due rows per Celery queue and dispatch them as ``bridge.execute``.

Each queue leases only up to its own free capacity (``max_inflight`` minus the leases
the bridge holds for its classes), so a flood in one queue never starves another. One
poll runs at a time (a database lock; an overlapping poll returns at once), so two
polls never both fill the same capacity. A full dispatch marks its middle task: when
that task has run, half the capacity is free and the worker asks for a poll at once, so
throughput is not capped at ``max_inflight / poll_interval``.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from typing import Any

from kombu import Queue
from kombu.utils.uuid import uuid

from bridge.celery import app
from bridge.handlers.conduit_proxy import ConduitProxyHandler
from bridge.queue import Task
from bridge.queue.model import new_owner
from bridge.queue.retry import DatabaseUnavailable, is_transient
from bridge.runtime.consumers import ConsumerWatch, survey
from bridge.runtime.context import Runtime, runtime
from bridge.runtime.execute import EXECUTE_TASK
from bridge.runtime.metrics import DISPATCHED
from bridge.runtime.tracing import TRACEPARENT_HEADER, TaskTrace, new_traceparent, traced

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


def publish(
    producer: Any, queue: Queue, args: tuple, kwargs: dict, argsrepr: str, trace: TaskTrace
) -> None:
    """Send one ``bridge.execute`` message with Celery's own message builder and sender.

    ``apply_async`` would cost twice as much a message here: it routes, adds the result to
    the poll's trail and builds an AsyncResult nobody reads. The sender still fires the
    publish signals and, with ``BRIDGE_TASK_EVENTS``, the task-sent events.
    """
    amqp = app.amqp
    message = amqp.create_task_message(
        uuid(),
        EXECUTE_TASK,
        args,
        kwargs,
        create_sent_event=app.conf.task_send_sent_event,
        ignore_result=True,
        argsrepr=argsrepr,
        kwargsrepr="{}",
    )
    amqp.send_task_message(
        producer,
        EXECUTE_TASK,
        message,
        queue=queue,
        declare=[],
        retry=False,  # a refusal hands the unsent leases back (dispatch)
        headers={TRACEPARENT_HEADER: trace.traceparent},
    )


def dispatch(rt: Runtime, tasks: list[Task], queue: str, limit: int) -> int:
    """Send leased rows to their queue; returns how many were sent before any error."""
    inline_max = rt.settings.inline_data_max
    # The middle of a dispatch that took at least half the capacity asks for the next poll.
    marked = len(tasks) // 2 if len(tasks) >= max(1, limit // 2) else None
    target = app.amqp.queues[queue]
    with app.producer_or_acquire() as producer:
        # Declared once per dispatch: kombu's per-message check binds a copy of the queue
        # for every message, a fifth of the cost of a publish.
        producer.maybe_declare(target)
        for index, task in enumerate(tasks):
            kwargs: dict[str, object] = {"taskClass": task.taskClass}
            if task.rawData is not None and len(task.rawData) <= inline_max:
                kwargs["data"] = task.rawData
            if index == marked:
                kwargs["repoll"] = True
            trace = TaskTrace(task.id, task.taskClass, task.leaseOwner, new_traceparent())
            args = (task.id, task.leaseOwner, task.failureCount)
            try:
                publish(producer, target, args, kwargs, repr((task.label,)), trace)
            except Exception as exc:
                log.error("dispatch to %s failed after %d of %d: %s", queue, index, len(tasks), exc)
                return index
            DISPATCHED.labels(queue=queue, task_class=task.taskClass).inc()
            with traced(trace):
                log.info("%s: dispatched to %s", task.label, queue)
    return len(tasks)


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
            capacity = limit - sum(held.get(c, 0) for c in classes)
            if capacity <= 0:
                continue
            # The owner's epoch is the database's clock, as failureTime is.
            owner = new_owner(settings.owner_prefix, now)
            tasks = rt.queue.lease(
                capacity, owner, settings.dispatch_lease, classes=classes, expired_first=True
            )
            done = dispatch(rt, tasks, queue, limit)
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
