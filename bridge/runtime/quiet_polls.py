"""``bridge.poll`` (and ``bridge.canary_guard``, beside it) out of Flower's sight and out
of beat's and the worker's log at INFO.

Beat sends a poll every poll interval, 14,400 an hour at 0.25 s: as tasks they filled
Flower's list and its counts (Flower counts messages, not Phorge's tasks), beat logged a
line for each and a worker two. A poll sends no task events and no task-sent event, and
Celery's INFO lines about sending and running it are dropped; its warnings and errors
still log, and the poll's own metrics (``bridge.metrics.observed_poll``) still
count every one. Beat's log says when it starts sending and when it stands by (the beat
lock's lines).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery import Task

from bridge.runtime.tasks import GUARD_TASK, POLL_TASK

if TYPE_CHECKING:
    from celery.result import AsyncResult

    BaseTask = Task[Any, Any]
else:
    BaseTask = Task  # not subscriptable at run time

# Celery's loggers of "Task bridge.poll[...] received", "... succeeded in ..." (the
# worker) and "Scheduler: Sending due task poll-phorge-queue (bridge.poll)" (beat).
CELERY_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")


class NoSentEvent:
    """An event dispatcher for ``send_task_message`` that drops the task-sent event."""

    def publish(self, *_args: Any, **_kwargs: Any) -> None:
        pass


class QuietTask(BaseTask):
    """A task type that shows in no task event: the worker sends none about it
    (``send_events``), and sending it sends no task-sent event, which Flower would show
    as a task PENDING for ever (``BRIDGE_TASK_EVENTS`` turns those on for every message,
    and beat sends the poll through here)."""

    send_events = False

    def apply_async(self, *args: Any, **options: Any) -> AsyncResult[Any]:
        options.setdefault("event_dispatcher", NoSentEvent())
        return super().apply_async(*args, **options)


QUIET_TASKS = (POLL_TASK, GUARD_TASK)  # sent several times a second, by beat


def names_a_quiet_task(args: object) -> bool:
    """Whether a line's arguments name a quiet task: the worker's lines have a mapping
    with the task's name, beat's a tuple of the entry's name and its task."""
    if isinstance(args, Mapping):
        return args.get("name") in QUIET_TASKS
    return isinstance(args, tuple) and any(task in args for task in QUIET_TASKS)


class QuietLines(logging.Filter):
    """Drops Celery's INFO lines about a poll or a guard run; other levels pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno != logging.INFO or not names_a_quiet_task(record.args)


QUIET = QuietLines()


def install() -> None:
    """Filter Celery's loggers, in this process (beat, a worker) and in those it forks
    (the pool's children log the "succeeded" line; ``addFilter`` adds the filter once)."""
    for name in CELERY_LOGGERS:
        logging.getLogger(name).addFilter(QUIET)
