"""``bridge.poll``: lease due rows per Celery queue and dispatch them as ``bridge.execute``.

Each queue leases only up to its own free capacity (``max_inflight`` minus the leases
the bridge holds for its classes), so a flood in one queue never starves another.
Duplicate or overlapping polls are harmless: the guarded lease UPDATE arbitrates.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from bridge.app import app
from bridge.metrics import DISPATCHED
from bridge.model import Task, new_owner
from bridge.runtime import Runtime, runtime

log = logging.getLogger(__name__)


def plan(rt: Runtime) -> dict[str, list[str]]:
    """Runnable task classes present in the queue, grouped by the Celery queue serving them."""
    by_queue: dict[str, list[str]] = defaultdict(list)
    for task_class in rt.registry.runnable(rt.queue.task_classes()):
        by_queue[rt.settings.router.queue_for(task_class)].append(task_class)
    return by_queue


def dispatch(rt: Runtime, task: Task, queue: str) -> None:
    """Send one leased row to its queue; the message dies before the dispatch lease does."""
    from bridge.execute import execute

    settings = rt.settings
    inline = task.rawData if len(task.rawData or "") <= settings.inline_data_max else None
    remaining = (task.leaseExpires or 0) - (task.serverTime or 0)
    execute.apply_async(
        args=(task.id, task.leaseOwner),
        kwargs={"data": inline, "taskClass": task.taskClass},
        queue=queue,
        expires=max(1.0, remaining - settings.poll_interval),
        argsrepr=repr((task.label,)),
        kwargsrepr="{}",
    )
    DISPATCHED.labels(queue=queue, task_class=task.taskClass).inc()


def poll_once(rt: Runtime) -> int:
    """One poll; returns how many tasks were dispatched."""
    settings = rt.settings
    held = rt.queue.held_by_class(settings.owner_prefix)
    sent = 0
    for queue, classes in plan(rt).items():
        capacity = settings.max_inflight.for_queue(queue) - sum(held.get(c, 0) for c in classes)
        if capacity <= 0:
            continue
        owner = new_owner(settings.owner_prefix)
        tasks = rt.queue.lease(capacity, owner, settings.dispatch_lease, classes=classes)
        for index, task in enumerate(tasks):
            try:
                dispatch(rt, task, queue)
            except Exception:
                # The broker refused: hand the unsent leases back at once rather than
                # letting them wait out the dispatch lease.
                rt.queue.free_own([t.id for t in tasks[index:]], owner)
                raise
            sent += 1
    return sent


@app.task(name="bridge.poll", acks_late=False, ignore_result=True)
def poll() -> int:
    """Beat's periodic poll of Phorge's queue."""
    sent = poll_once(runtime())
    if sent:
        log.info("dispatched %d task(s)", sent)
    return sent
