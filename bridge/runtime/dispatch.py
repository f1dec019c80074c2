"""Leased rows to Celery messages: one ``bridge.execute`` a task, or, under a backlog,
``bridge.execute_batch`` messages carrying several tasks of one queue each (how many:
``bridge.engine.poll.batch_size``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from celery import Celery
from kombu import Queue
from kombu.utils.uuid import uuid

from bridge.engine.metrics import DISPATCHED
from bridge.engine.tracing import TRACEPARENT_HEADER, TaskTrace, new_traceparent, traced
from bridge.queue.model import Leased

log = logging.getLogger(__name__)

EXECUTE_TASK = "bridge.execute"
EXECUTE_BATCH = "bridge.execute_batch"


def publish(
    app: Celery,
    producer: Any,
    queue: Queue,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argsrepr: str,
    trace: str,
) -> None:
    """Send one message with Celery's own message builder and sender.

    ``apply_async`` would cost twice as much a message here: it routes, adds the result to
    the poll's trail and builds an AsyncResult nobody reads. The sender still fires the
    publish signals and, with ``BRIDGE_TASK_EVENTS``, the task-sent events.
    """
    amqp = app.amqp
    message = amqp.create_task_message(
        uuid(),
        name,
        args,
        kwargs,
        create_sent_event=app.conf.task_send_sent_event,
        ignore_result=True,
        argsrepr=argsrepr,
        kwargsrepr="{}",
    )
    amqp.send_task_message(
        producer,
        name,
        message,
        queue=queue,
        declare=[],
        retry=False,  # a refusal hands the unsent leases back (the caller)
        headers={TRACEPARENT_HEADER: trace},
    )


def send(
    app: Celery, owner: str, tasks: Sequence[Leased], queue: str, size: int, mark: bool = False
) -> int:
    """Send ``tasks`` (leased by ``owner``) to ``queue``, ``size`` a message; returns how
    many were sent before any error. ``mark`` asks the middle message to poll once run
    (``bridge.engine.poll.Send``, with the app bound)."""
    groups = [tasks[at : at + size] for at in range(0, len(tasks), size)]
    marked = len(groups) // 2 if mark else None
    target = app.amqp.queues[queue]
    sent = 0
    with app.producer_or_acquire() as producer:
        # Declared once per dispatch: kombu's per-message check binds a copy of the queue
        # for every message, a fifth of the cost of a publish.
        producer.maybe_declare(target)
        for index, group in enumerate(groups):
            kwargs: dict[str, object] = {"repoll": True} if index == marked else {}
            traceparent = new_traceparent()
            args: tuple[Any, ...]
            if len(group) == 1:
                task = group[0]
                name, args = EXECUTE_TASK, (task.id, owner, task.failure_count)
                kwargs["task_class"] = task.task_class
                if task.data is not None:
                    kwargs["data"] = task.data
            else:
                name, args = EXECUTE_BATCH, (owner, [list(task) for task in group])
            try:
                argsrepr = repr(tuple(task.label for task in group))
                publish(app, producer, target, name, args, kwargs, argsrepr, traceparent)
            except Exception as exc:
                log.error("dispatch to %s failed after %d of %d: %s", queue, sent, len(tasks), exc)
                break
            sent += len(group)
            if log.isEnabledFor(logging.INFO):
                for task in group:
                    with traced(TaskTrace(task.id, task.task_class, owner, traceparent)):
                        log.info("%s: dispatched to %s", task.label, queue)
    for task_class, n in Counter(task.task_class for task in tasks[:sent]).items():
        DISPATCHED.labels(queue=queue, task_class=task_class).inc(n)
    return sent
