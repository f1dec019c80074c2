"""The fault suite's handler, installed in the workers by ``tests/faults/conftest.py``.

``FaultTask`` appends one JSON line per run to ``$PHORGE_BRIDGE_TEST_RECORD_FILE`` before
it does anything else, naming the lease it runs under (``bridge.execute``'s own
arguments: id, owner, failure count), so a run survives in the record even when its
worker is killed a moment later. Data keys: ``duration`` (seconds to sleep) and
``failTimes`` (fail temporarily while the failure count is below it).
"""

from __future__ import annotations

import json
import os
import time

from celery import current_task

from bridge.handlers.api import Handler, TaskContext


def record(task: TaskContext) -> None:
    task_id, owner, failure_count = current_task.request.args[:3]
    line = json.dumps(
        {
            "event": "start",
            "id": task_id,
            "owner": owner,
            "failureCount": failure_count,
            "worker": os.environ.get("PHORGE_BRIDGE_TEST_WORKER", "?"),
            "pid": os.getpid(),
            "time": time.time(),  # this host's clock, shifted in the clock-skew scenarios
        }
    )
    # One short write to an O_APPEND file: concurrent runs' lines never mix.
    fd = os.open(
        os.environ["PHORGE_BRIDGE_TEST_RECORD_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT
    )
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


class FaultTask(Handler):
    task_classes = ("FaultTask",)

    def run(self, task: TaskContext) -> None:
        record(task)
        data = task.data if isinstance(task.data, dict) else {}
        if task.failure_count < data.get("failTimes", 0):
            raise RuntimeError(f"failing on purpose ({task.failure_count + 1})")
        time.sleep(float(data.get("duration", 0)))
