"""EVERY use of the bridge's Python API by the bench, public seams only, imported inside
the functions (the rest of the kit runs without the bridge). Otherwise the bridge is a black
box: ``celery -A bridge beat|worker``, ``BRIDGE_*`` settings and the task names below."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CELERY_APP = "bridge"  # celery -A bridge
POLL_TASK = "bridge.poll"
RUN_RECORD = "bridge.run"  # the record of one Phorge task's run (``records.record_runs``)
SQL_LOOP_RECORD = "sqlloop"


def observe_runs(started: Callable[[int], None], ended: Callable[[int], None]) -> None:
    """``started(id)`` as each Phorge task's run begins (its lease checked), ``ended(id)``
    once its outcome is written, through the engine's observer."""
    from bridge.engine import RunObserver, observe

    class Timing(RunObserver):
        def run_started(self, lease: Any) -> None:
            started(lease.task_id)

        def run_ended(self, item: Any, ran: Any) -> None:
            ended(item.id)

    observe(Timing())


def sql_loop(ready: Path) -> None:
    """The bridge's per-task SQL without Celery, a ceiling: polls' leases, each message's
    worth run in process, until a poll leases nothing. Touches ``ready`` after one empty
    poll, drains on a line on stdin, then waits to be stopped (the bench reads its CPU first)."""
    from bridge.assembly import build_runtime
    from bridge.config import current_settings
    from bridge.engine import Batch, poll_once

    rt = build_runtime(current_settings())

    def send(owner: str, tasks: Sequence[Any], queue: str, size: int, repoll_at: Any = None) -> int:
        for at in range(0, len(tasks), size):  # a message's worth, as a worker runs them
            Batch(rt, owner, None).run(tasks[at : at + size])
        return len(tasks)

    poll_once(rt, send)
    ready.touch()
    sys.stdin.readline()
    while poll_once(rt, send):
        pass
    sys.stdin.read()


if __name__ == "__main__":  # the SQL loop ceiling: python3 -m benchkit.bridge_api READY RECORDS
    from benchkit import records

    records.record_runs(records.RecordWriter(sys.argv[2]), SQL_LOOP_RECORD)
    sql_loop(Path(sys.argv[1]))
