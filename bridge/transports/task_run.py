"""The task run's protocol: what Python sends PHP for one task and how PHP's answer ends it.

Mirrors ``PhorgeBridgeTaskRun.php`` (beside this file), which both PHP transports run: the
runner's processes and Conduit's ``worker.execute``. :func:`execute_params` is the task
spec PHP reads; :func:`apply_result` turns the run's answer into the handler's outcome
(return, or raise :class:`Yield`, :class:`PermanentFailure`, :class:`TemporaryFailure`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from bridge.handlers.api import (
    PermanentFailure,
    TaskContext,
    TemporaryFailure,
    Yield,
    report_measured_duration,
    report_scheduled,
    stored_data,
)
from bridge.queue.model import MIN_YIELD_SECONDS, PRIORITY_DEFAULT, Outcome, check_priority

logger = logging.getLogger(__name__)

# How long a task yields while Phorge is read-only (both transports hear it from PHP).
READ_ONLY_YIELD = 300


def raw_task_data(task: TaskContext) -> str:
    """The task's worker_taskdata.data string, untouched when the runtime provides it.

    PHP must decode the very bytes Phorge stored; re-encoding is only a fallback (it is
    lossless for JSON's values, Python ints being exact).
    """
    raw = stored_data(task)
    return raw if isinstance(raw, str) else json.dumps(task.data)


def execute_params(task: TaskContext) -> dict[str, Any]:
    """The ``worker.execute`` parameters for one leased task."""
    return {
        "taskID": task.id,
        "taskClass": task.task_class,
        "data": raw_task_data(task),
        "failureCount": task.failure_count,
        "priority": task.priority,
        "objectPHID": task.object_phid,
        "containerPHID": task.container_phid,
        "traceparent": task.traceparent,
    }


def optional_int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _queue_followups(task: TaskContext, followups: Any) -> None:
    """Queue what the PHP worker queued; a malformed entry is logged and skipped, because
    failing here would re-run a worker that already succeeded."""
    if followups in (None, []):
        return
    if not isinstance(followups, list):
        logger.error("task %s: worker.execute returned malformed followups; ignored", task.id)
        return
    for entry in followups:
        if not isinstance(entry, dict) or not isinstance(entry.get("taskClass"), str):
            logger.error("task %s: malformed follow-up %r skipped", task.id, entry)
            continue
        options = entry.get("options")
        # PHP encodes an empty options array as [].
        if not isinstance(options, dict):
            options = {}
        priority = optional_int(options.get("priority"))
        try:
            check_priority(priority if priority is not None else PRIORITY_DEFAULT)
        except ValueError as exc:
            # PHP would write it; the queue refuses it: the parent's, as for a native parent.
            logger.warning(
                "task %s: follow-up %.64s gets the default priority instead of %s: %s",
                task.id,
                entry["taskClass"],
                priority,
                exc,
            )
            priority = None
        try:
            task.queue_task(
                entry["taskClass"],
                entry.get("data"),
                priority=priority,
                object_phid=options.get("objectPHID") or None,
                container_phid=options.get("containerPHID") or None,
                delay_until=optional_int(options.get("delayUntil")) or None,
            )
        except ValueError as exc:  # the queue would refuse it when archiving the parent
            logger.error(
                "task %s: follow-up %.64s skipped, the queue refuses it: %s",
                task.id,
                entry["taskClass"],
                exc,
            )


def apply_result(task: TaskContext, result: Any) -> None:
    """Turn a ``worker.execute`` result into the handler outcome (return or raise).

    Its ``result`` is one of the queue's :class:`Outcome` values, as the extension sends.
    """
    if not isinstance(result, dict):
        raise TemporaryFailure(f"worker.execute returned {type(result).__name__}, not a dict")
    for warning in result.get("warnings") or ():
        logger.warning("task %s (%s): Phorge: %s", task.id, task.task_class, warning)
    outcome = result.get("result")
    message = result.get("message") or ""
    if outcome == Outcome.SUCCESS:
        duration = optional_int(result.get("duration"))
        if duration is not None and duration >= 0:
            report_measured_duration(task, duration)
        _queue_followups(task, result.get("followups"))
        report_scheduled(task, optional_int(result.get("scheduled")) or 0)
        return
    if outcome == Outcome.YIELD:
        seconds = optional_int(result.get("yieldDuration")) or 0
        raise Yield(delay=max(seconds, MIN_YIELD_SECONDS))
    if outcome == Outcome.PERMANENT_FAILURE:
        raise PermanentFailure(message or "permanent failure (no message)")
    if outcome == Outcome.FAILURE:
        raise TemporaryFailure(
            message or "failure (no message)", delay=optional_int(result.get("retryWait"))
        )
    logger.error("task %s: worker.execute returned unknown result %r", task.id, outcome)
    raise TemporaryFailure(f"worker.execute returned an unknown result: {outcome!r}")
