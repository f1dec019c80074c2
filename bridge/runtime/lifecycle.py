"""Worker lifecycle hooks: metrics exporter at start, lease hand-back at warm shutdown."""

from __future__ import annotations

import logging

from celery.signals import worker_ready, worker_shutting_down
from celery.worker import state

from bridge.queue import Lease
from bridge.runtime.context import runtime
from bridge.runtime.metrics import serve

log = logging.getLogger(__name__)


@worker_ready.connect
def start_metrics(**_kwargs) -> None:
    settings = runtime().settings
    if settings.metrics_port:
        serve(settings.metrics_port, settings.metrics_address, runtime().queue)
        log.info("metrics on %s:%d", settings.metrics_address, settings.metrics_port)


def unstarted_leases() -> list[Lease]:
    """Leases of bridge.execute messages this worker holds but has not started."""
    waiting = set(state.reserved_requests) - set(state.active_requests)
    return [Lease(*r.args[:3]) for r in waiting if r.name == "bridge.execute" and len(r.args) >= 3]


def free_unstarted() -> int:
    """Hand back unstarted leases so another worker runs them at once, not after expiry."""
    freed = 0
    for lease in unstarted_leases():
        try:
            freed += runtime().queue.free_own([lease.task_id], lease.owner)
        except Exception as exc:  # shutting down: the lease will expire on its own
            log.warning("could not free the lease of task %s: %s", lease.task_id, exc)
    return freed


@worker_shutting_down.connect
def hand_back_leases(**_kwargs) -> None:
    freed = free_unstarted()
    if freed:
        log.info("handed back %d unstarted lease(s)", freed)
