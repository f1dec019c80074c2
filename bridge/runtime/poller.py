"""``bridge.poll``: beat's periodic poll of Phorge's queue (``bridge.engine.poll``),
dispatching what it leases as Celery messages; registered on an app by :func:`install`.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any

from celery import Celery, Task

from bridge.engine.context import Runtime, runtime
from bridge.engine.metrics import observed_poll
from bridge.engine.poll import poll_once
from bridge.queue.retry import DatabaseUnavailable, is_transient
from bridge.runtime.consumers import ConsumerWatch, survey
from bridge.runtime.dispatch import send
from bridge.runtime.execute import POLL_TASK
from bridge.runtime.quiet_polls import QuietTask

log = logging.getLogger(__name__)

_watches: dict[int, ConsumerWatch] = {}


def watch_consumers(app: Celery, rt: Runtime) -> None:
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


def poll(self: Task[Any, Any]) -> int:
    """Beat's periodic poll of Phorge's queue (and the one a marked task asks for)."""
    app = self.app
    try:
        with observed_poll():  # its time, its errors, when the last one ended
            rt = runtime()
            sent = poll_once(rt, partial(send, app))
            watch_consumers(app, rt)
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
