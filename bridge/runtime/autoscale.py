"""``celery worker --autoscale`` without killing tasks: the pool shrinks only while idle.

Celery's autoscaler shrinks the prefork pool with billiard's ``Pool.shrink``, which
terminates (SIGTERM) the processes it finds inactive: those that no unfinished job names
as its worker. A job names its process only once the main process has read the child's
ack, which the child sends as it starts the job; until then a child that has just taken
a task, and is running it, counts as inactive. A scale-down in that moment (fewer
requests reserved than processes: at the edges of a burst, or ``celery control
autoscale``) killed the task mid-run (issue 29; celery/celery#7266). Its message had been
acked as it started (``task_acks_late = False``), so nothing redelivered it: Celery
logged a ``WorkerLostError`` and the row waited out its dispatch lease, 300 s, while the
rest of the backlog drained in 17 s.

:class:`Autoscaler` shrinks only a pool that holds no task, so every process it
terminates is idle; a message handed to the pool right after may go to one of them,
which exits without starting it, and billiard sends it to another process. A shrink put
off is tried again at the next message or keepalive (``AUTOSCALE_KEEPALIVE``, 30 s): the
pool shrinks back once a backlog has drained, not in the middle of one. Without an event
loop (the SQLite broker) Celery scales from a thread of its own, which races the pool's
threads, so the autoscaler refuses to start there.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from celery.concurrency.base import BasePool
from celery.worker import autoscale, state
from celery.worker.request import Request

log = logging.getLogger(__name__)

# What a worker without an event loop lost: tasks taken from the pool's shared queue by a
# process being terminated (their messages reserved for good, never started), or itself
# (billiard's supervisor thread crashed on a process the autoscaler was starting).
WITHOUT_EVENT_LOOP = (
    "--autoscale needs a broker with an event loop (RabbitMQ or Redis): without one, "
    "Celery's autoscaler loses tasks; with the SQLite broker, give the worker a fixed -c"
)


class Autoscaler(autoscale.Autoscaler):
    """Celery's autoscaler, shrinking the pool only while no task is in it (Celery's
    ``worker_autoscaler``); refused without an event loop."""

    receiving: Request | None = None

    def __init__(
        self,
        pool: BasePool,
        max_concurrency: int,
        min_concurrency: int = 0,
        worker: Any = None,
        **kwargs: Any,
    ) -> None:
        if worker is not None and not worker.use_eventloop:
            raise SystemExit(f"Error: {WITHOUT_EVENT_LOOP}")
        super().__init__(pool, max_concurrency, min_concurrency, worker=worker, **kwargs)

    def maybe_scale(self, req: Request | None = None) -> None:
        """Scale as Celery does; ``req`` is a message just received: reserved, but not
        handed to the pool yet."""
        self.receiving = req
        try:
            super().maybe_scale(req)
        finally:
            self.receiving = None

    def _shrink(self, n: int) -> None:
        # Active ones too: a broker reconnect empties the reserved set, not the pool.
        reserved = len(state.reserved_requests) - (self.receiving is not None)
        if reserved > 0 or state.active_requests:
            log.debug("not scaling down while the pool holds a task")
            return
        # ``Autoscaler._shrink`` is private: celery-types does not declare it.
        cast(Any, super())._shrink(n)
