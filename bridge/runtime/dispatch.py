"""Leased rows to Celery messages: one ``bridge.execute`` a task, or, under a backlog,
``bridge.execute_batch`` messages carrying several tasks of one queue each (how many:
``bridge.engine.poll.batch_size``).

Flower shows a message's arguments as its tasks' labels, ``('Class#12', 'Class#13')``,
and its keyword arguments as their ids and classes, ``{12: 'Class', 13: 'Class'}``,
which Flower's search matches as exact pairs: :func:`search_term`, ``kwargs:12=Class``,
finds the messages that carried task 12 and not those of 120 or 112 (a substring of
the label, ``Class#12``, would).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery
from kombu import Queue
from kombu.utils.uuid import uuid

from bridge.engine.tracing import TRACEPARENT_HEADER, TaskTrace, new_traceparent, traced
from bridge.metrics import DISPATCHED, SENT_ON, TASKS_PER_MESSAGE
from bridge.queue.model import Leased

log = logging.getLogger(__name__)

EXECUTE_TASK = "bridge.execute"
EXECUTE_BATCH = "bridge.execute_batch"


@dataclass(frozen=True)
class Sent:
    """A message sent: its task name, its Celery id, and the Phorge tasks it carries."""

    name: str
    message_id: str
    tasks: Sequence[Leased]

    def __str__(self) -> str:
        """As Celery's log lines name a message, ``bridge.execute[<id>]``."""
        return f"{self.name}[{self.message_id}]"


def labels_repr(tasks: Sequence[Leased]) -> str:
    """A message's arguments as Flower shows them: its tasks' labels."""
    return repr(tuple(task.label for task in tasks))


def ids_repr(tasks: Sequence[Leased]) -> str:
    """A message's keyword arguments as Flower shows them: each task's id and class,
    the pairs :func:`search_term` finds."""
    return repr({task.id: task.task_class or "" for task in tasks})


def search_term(task: Leased) -> str:
    """What Flower's search box takes to find every message that carried ``task`` (its
    runs, the batch that sent it on, a yield and its later run), and no other."""
    return f"kwargs:{task.id}={task.task_class or ''}"


def publish(
    app: Celery,
    producer: Any,
    queue: Queue,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    argsrepr: str,
    kwargsrepr: str,
    trace: str,
) -> str:
    """Send one message with Celery's own message builder and sender; returns its id.

    ``apply_async`` would cost twice as much a message here: it routes, adds the result to
    the poll's trail and builds an AsyncResult nobody reads. The sender still fires the
    publish signals and, with ``BRIDGE_TASK_EVENTS``, the task-sent events.
    """
    amqp = app.amqp
    message_id = uuid()
    message = amqp.create_task_message(
        message_id,
        name,
        args,
        kwargs,
        create_sent_event=app.conf.task_send_sent_event,
        ignore_result=True,
        argsrepr=argsrepr,
        kwargsrepr=kwargsrepr,
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
    return message_id


def send(
    app: Celery,
    owner: str,
    tasks: Sequence[Leased],
    queue: str,
    size: int,
    repoll_at: int | None = None,
) -> int:
    """The poll's dispatch (``bridge.engine.poll.Send``, with the app bound): how many of
    ``tasks`` :func:`send_messages` sent before any error."""
    messages = send_messages(app, owner, tasks, queue, size, repoll_at)
    return sum(len(message.tasks) for message in messages)


def send_messages(
    app: Celery,
    owner: str,
    tasks: Sequence[Leased],
    queue: str,
    size: int,
    repoll_at: int | None = None,
    sent_on: bool = False,
) -> list[Sent]:
    """Send ``tasks`` (leased by ``owner``) to ``queue``, ``size`` a message; returns the
    messages sent before any error. Message ``repoll_at`` (an index) asks for a poll once run.
    ``sent_on``: tasks a batch had no time for, counted apart from the poll's dispatches
    (the batch's result names the messages)."""
    groups = [tasks[at : at + size] for at in range(0, len(tasks), size)]
    target = app.amqp.queues[queue]
    messages: list[Sent] = []
    sent = 0
    with app.producer_or_acquire() as producer:
        # Declared once per dispatch: kombu's per-message check binds a copy of the queue
        # for every message, a fifth of the cost of a publish.
        producer.maybe_declare(target)
        for index, group in enumerate(groups):
            kwargs: dict[str, object] = {"repoll": True} if index == repoll_at else {}
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
                reprs = labels_repr(group), ids_repr(group)
                message_id = publish(app, producer, target, name, args, kwargs, *reprs, traceparent)
            except Exception as exc:
                log.error("dispatch to %s failed after %d of %d: %s", queue, sent, len(tasks), exc)
                break
            messages.append(Sent(name, message_id, group))
            sent += len(group)
            TASKS_PER_MESSAGE.labels(queue=queue).observe(len(group))
            if log.isEnabledFor(logging.INFO):
                for task in group:
                    with traced(TaskTrace(task.id, task.task_class, owner, traceparent)):
                        log.info("%s: dispatched to %s", task.label, queue)
    counter = SENT_ON if sent_on else DISPATCHED
    for task_class, n in Counter(task.task_class or "unknown" for task in tasks[:sent]).items():
        counter.labels(queue=queue, task_class=task_class).inc(n)
    return messages
