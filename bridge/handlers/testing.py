"""Run a handler in a test, without a database or Celery, and see how the run ended.

The data makes the round trip through PHP-compatible JSON first, as it does in Phorge,
so a handler meets lists where a test wrote tuples, and data the queue would refuse is
refused here too. The run is cleared and classified by the code the worker itself uses:
past the handler's maximum retry count it fails permanently, unrun; a yield lasts at
least 5 s; the lease the handler requires, which a worker would claim, is reported
(``HandlerResult.required_lease``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bridge.handlers.api import Handler, TaskContext
from bridge.handlers.outcome import HandlerResult, clear, run_handler
from bridge.phorge.php import decode_data, encode_data
from bridge.queue.model import PRIORITY_DEFAULT

__all__ = ["HandlerResult", "run"]


def run(
    handler: Handler,
    data: Any = None,
    *,
    task_class: str | None = None,
    failure_count: int = 0,
    priority: int = PRIORITY_DEFAULT,
    task_id: int = 1,
    object_phid: str | None = None,
    container_phid: str | None = None,
    lease_owner: str = "bridge:test",
) -> HandlerResult:
    """Run ``handler`` once on ``data`` as task ``task_class`` (default: its first class),
    as a worker would run it with this failure count."""
    if task_class is None:
        if not handler.task_classes:
            raise ValueError(f"{handler.name} serves no class of its own; pass task_class")
        task_class = handler.task_classes[0]
    raw = encode_data(data)
    decoded, _ = decode_data(raw)
    ctx = TaskContext(
        id=task_id,
        task_class=task_class,
        data=decoded,
        failure_count=failure_count,
        priority=priority,
        object_phid=object_phid,
        container_phid=container_phid,
        raw_data=raw,
        lease_owner=lease_owner,
    )
    cleared = clear(handler, ctx)
    if isinstance(cleared, HandlerResult):
        return cleared
    return replace(run_handler(handler, ctx), required_lease=cleared.required_lease)
