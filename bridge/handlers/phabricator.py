"""``PhabricatorTestWorker`` with Phorge's test-worker semantics, natively in Python.

Data keys: ``duration`` (seconds to sleep), ``doWork`` (``fail-temporary`` or
``fail-permanent``), and the policy overrides ``getRequiredLeaseTime``,
``getMaximumRetryCount`` and ``getWaitBeforeRetry``. The bridge adds two keys of its
own for demos and tests: ``doWork: "yield"`` yields until the epoch ``yieldUntil`` has
passed, and ``followups`` (a list of ``{"taskClass", "data", "priority"}``) are
queued on success. Without ``getWaitBeforeRetry`` a failure waits Phorge's flat 300 s.
"""

from __future__ import annotations

import time
from typing import Any

from bridge.handlers.api import Handler, PermanentFailure, TaskContext, Yield


def _option(task: TaskContext, key: str) -> Any:
    return task.data.get(key) if isinstance(task.data, dict) else None


def _policy(task: TaskContext, key: str) -> int | None:
    """A policy override from the data (seconds or a count), as the data gives it."""
    value: int | None = _option(task, key)
    return value


class PhabricatorTestWorker(Handler):
    task_classes = ("PhabricatorTestWorker",)
    phorge_defaults = True

    def required_lease(self, task: TaskContext) -> int | None:
        return _policy(task, "getRequiredLeaseTime")

    def maximum_retry_count(self, task: TaskContext) -> int | None:
        return _policy(task, "getMaximumRetryCount")

    def wait_before_retry(self, task: TaskContext) -> int | None:
        return _policy(task, "getWaitBeforeRetry")

    def run(self, task: TaskContext) -> None:
        duration = _option(task, "duration")
        if duration:
            time.sleep(float(duration))
        match _option(task, "doWork"):
            case "fail-temporary":
                raise RuntimeError("Temporary failure!")
            case "fail-permanent":
                raise PermanentFailure("Permanent failure!")
            case "yield" if (_option(task, "yieldUntil") or 0) > time.time():
                raise Yield(delay=int(_option(task, "yieldUntil") - time.time()) + 1)
        for followup in _option(task, "followups") or ():
            task.queue_task(
                followup["taskClass"],
                followup.get("data"),
                priority=followup.get("priority"),
            )
