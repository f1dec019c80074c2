"""A native handler that records every run, published by the acceptance fixtures.

``tests/helpers/bridge_harness.py`` copies this module into a directory of its own with a
``.dist-info`` whose ``entry_points.txt`` registers it in the ``phorge_bridge.handlers``
group, and puts that directory on the workers' ``PYTHONPATH``: the product discovers it
exactly as it would a third-party package's handlers.

It behaves like ``PhabricatorTestWorker`` (same data keys) for the classes ``RecordedA``,
``RecordedB`` and ``RecordedC``, plus ``failTimes`` (fail temporarily while the task's
failure count is below it, raised from :func:`fail_on_purpose`, which a failure's
traceback names) and ``yieldFirst`` (yield that many seconds on the first run, however
late it starts: a deadline set at enqueue would depend on start-up time).
Each run appends a JSON line to ``$PHORGE_BRIDGE_TEST_RECORD_FILE``
when it starts and when it ends, naming the worker (``$PHORGE_BRIDGE_TEST_WORKER``) and the
process that ran it.
"""

from __future__ import annotations

import json
import os

import run_record

from bridge.handlers.api import TaskContext, Yield
from bridge.handlers.phabricator import PhabricatorTestWorker


def runs_so_far(task_id: int) -> int:
    """How many runs of ``task_id`` have started, from the record file."""
    with open(os.environ["PHORGE_BRIDGE_TEST_RECORD_FILE"], encoding="utf-8") as lines:
        starts = (json.loads(line) for line in lines)
        return sum(1 for r in starts if r["event"] == "start" and r["id"] == task_id)


def record(event: str, task: TaskContext) -> None:
    run_record.append(
        {
            "event": event,
            "id": task.id,
            "taskClass": task.task_class,
            "failureCount": task.failure_count,
        }
    )


def fail_on_purpose(task: TaskContext, times: int) -> None:
    raise RuntimeError(f"failing on purpose ({task.failure_count + 1} of {times})")


class RecordingTestWorker(PhabricatorTestWorker):
    task_classes = ("RecordedA", "RecordedB", "RecordedC")
    phorge_defaults = False  # classes Phorge does not have: the bridge's backoff

    def run(self, task: TaskContext) -> None:
        record("start", task)
        data = task.data if isinstance(task.data, dict) else {}
        if task.failure_count < data.get("failTimes", 0):
            fail_on_purpose(task, data["failTimes"])
        if "yieldFirst" in data and runs_so_far(task.id) == 1:
            raise Yield(delay=data["yieldFirst"])
        super().run(task)
        record("end", task)
