"""``bridge.poll``: beat's periodic poll of Phorge's queue (``bridge.engine.poll``),
dispatching what it leases as Celery messages; registered on an app by :func:`install`.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

from celery import Celery, Task

from bridge.assembly import runtime
from bridge.engine.context import Runtime
from bridge.engine.poll import poll_once
from bridge.errors import DatabaseUnavailable
from bridge.metrics import observed_poll
from bridge.queue.retry import is_transient
from bridge.runtime.consumers import ConsumerWatch, fleet_survey
from bridge.runtime.dispatch import send
from bridge.runtime.quiet_polls import QuietTask
from bridge.runtime.tasks import POLL_TASK

log = logging.getLogger(__name__)

_watches: dict[int, ConsumerWatch] = {}


def consumer_watch(app: Celery, rt: Runtime) -> ConsumerWatch:
    """This process's watch of the queues' consumers, which logs queues left with due
    rows and no consumer, once per change."""
    pid = os.getpid()
    if pid not in _watches:
        _watches.clear()
        _watches[pid] = ConsumerWatch(
            lambda known: fleet_survey(app, rt.queue.stats(), rt.registry, rt.settings, known),
            log_changes=True,
        )
    return _watches[pid]


def poll(self: Task[Any, Any]) -> int:
    """Beat's periodic poll of Phorge's queue (and the one a marked task asks for).

    The control API is asked at most every ``ConsumerWatch.every`` seconds, on a thread
    of its own: the poll goes on at once with the last answer, and a failure to ask
    never fails it.
    """
    app = self.app
    try:
        with observed_poll():  # its time, its errors, when the last one ended
            rt = runtime()
            watch = consumer_watch(app, rt)
            node = self.request.hostname or ""
            sent = poll_once(rt, partial(send, app), partial(watch.runs_elsewhere, node=node))
            watch.refresh_soon()
    except Exception as exc:
        if not (isinstance(exc, DatabaseUnavailable) or is_transient(exc)):
            raise
        # The next poll tries again; one line, not a traceback per second.
        log.warning("poll skipped: database unavailable: %s", exc)
        return 0
    if sent:
        log.info("dispatched %d task(s)", sent)
    return sent


def install(app: Celery) -> None:
    """Register ``bridge.poll`` on ``app`` (beat sends it, see ``celeryconfig``), out of
    Flower's sight (``quiet_polls``)."""
    app.task(name=POLL_TASK, base=QuietTask, bind=True, acks_late=False, ignore_result=True)(poll)
