"""When a worker can run nothing of a Celery queue now, and for how long.

A worker whose transport is down (its PHP runner cannot boot, Conduit is unavailable)
hands back each leased task of it at once (``run.prepare``). That alone is not
enough: a worker that hands back at once is always ready for the next message, so it
would take most of a shared queue's messages and leave the healthy workers starved
(issue 31: 0.01x of the healthy rate). So it also stops consuming a queue on which it
can run nothing, until its transports are due to probe again; the runtime does the
stopping (``bridge.runtime.standby``).
"""

from __future__ import annotations

from collections.abc import Sequence

from bridge.engine.context import Runtime
from bridge.handlers.capabilities import availability_of

# Shortest standby: a probe that is due at once still leaves the queue to the others for
# this long, so a message bounced between two broken workers costs little.
MIN_STANDBY = 1.0


def standby_seconds(rt: Runtime, queue: str, present: Sequence[str] | None = None) -> float | None:
    """Seconds this process can run none of the classes queued for ``queue`` (``present``:
    the active table's classes, read when not given), until the first of their down
    transports probes again; None when it can run some of them (a native handler's
    class, or a transport that is up): then it hands back only the tasks it cannot run."""
    router, registry = rt.settings.router, rt.registry
    down = []
    for task_class in rt.queue.task_classes() if present is None else present:
        handler = registry.handler_for(task_class)
        if handler is None or router.queue_for(task_class) != queue:
            continue
        availability = availability_of(handler)
        if availability is None or not availability.is_down:
            return None
        down.append(availability)
    if not down:
        return None
    return max(MIN_STANDBY, min(transport.next_probe_in() for transport in down))
