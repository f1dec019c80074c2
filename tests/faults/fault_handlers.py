"""The fault suite's handler, installed in the workers by ``tests/faults/conftest.py``.

``FaultTask`` appends one JSON line per run to ``$PHORGE_BRIDGE_TEST_RECORD_FILE`` before
it does anything else, naming the lease it runs under (id, the lease owner the handler is given,
failure count), so a run survives in the record even when its
worker is killed a moment later. Data keys: ``duration`` (seconds to sleep) and
``failTimes`` (fail temporarily while the failure count is below it).
"""

from __future__ import annotations

import time

import run_record

from bridge import Handler, TaskContext


def record(task: TaskContext) -> None:
    run_record.append(
        {
            "event": "start",
            "id": task.id,
            "owner": task.lease_owner,
            "failureCount": task.failure_count,
        }
    )


class FaultTask(Handler):
    task_classes = ("FaultTask",)

    def run(self, task: TaskContext) -> None:
        record(task)
        data = task.data if isinstance(task.data, dict) else {}
        if task.failure_count < data.get("failTimes", 0):
            raise RuntimeError(f"failing on purpose ({task.failure_count + 1})")
        time.sleep(float(data.get("duration", 0)))
