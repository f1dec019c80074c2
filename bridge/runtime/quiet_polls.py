"""``bridge.poll`` out of Flower's sight and out of the worker's log at INFO.

Beat sends a poll every poll interval, 14,400 an hour at 0.25 s: as tasks they filled
Flower's list and its counts (Flower counts messages, not Phorge's tasks), and a worker
logged two INFO lines for each. A poll sends no task events and no task-sent event, and
Celery's INFO lines about running it are dropped; its warnings and errors still log, and
the poll's own metrics (``bridge.engine.metrics.observed_poll``) still count every one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery import Task

from bridge.runtime.execute import POLL_TASK

if TYPE_CHECKING:
    from celery.result import AsyncResult

    BaseTask = Task[Any, Any]
else:
    BaseTask = Task  # not subscriptable at run time

# Celery's loggers of "Task bridge.poll[...] received" and "... succeeded in ...". Beat's
# own "Sending due task" lines stay: they are how its log shows that it is sending.
CELERY_LOGGERS = ("celery.worker.strategy", "celery.app.trace")


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


class QuietPollLines(logging.Filter):
    """Drops Celery's INFO lines about a poll (their arguments, a mapping, name the task);
    lines at other levels pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        about_a_poll = isinstance(args, Mapping) and args.get("name") == POLL_TASK
        return record.levelno != logging.INFO or not about_a_poll


QUIET = QuietPollLines()


def install() -> None:
    """Filter Celery's loggers, in this process and in those it forks (the pool's
    children log the "succeeded" line; ``addFilter`` adds the filter once)."""
    for name in CELERY_LOGGERS:
        logging.getLogger(name).addFilter(QUIET)
