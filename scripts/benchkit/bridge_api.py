"""EVERY use of the bridge's Python API by the bench, and only here.

Public seams only, imported inside the functions (the rest of the kit runs without the
bridge installed): ``bridge.config.current_settings``, ``bridge.assembly.build_runtime``,
and ``bridge.engine``'s ``poll_once``, ``Batch``, ``observe`` and ``RunObserver``.
Otherwise the bridge is a black box: ``celery -A bridge beat|worker`` configured by ``BRIDGE_*``
variables, and the Celery task names below (its public contract: Flower shows them).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CELERY_APP = "bridge"  # celery -A bridge
POLL_TASK = "bridge.poll"
RUN_RECORD = "bridge.run"  # the record of one Phorge task's run (``records.record_runs``)
SQL_LOOP_RECORD = "sqlloop"
DEFAULT_POLL_INTERVAL = 0.25  # BRIDGE_POLL_INTERVAL's default (docs/settings.md)


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


def build_runtime() -> Callable[[Any], Any]:
    """``bridge.assembly.build_runtime``: the runtime a worker builds from its settings."""
    from bridge.assembly import build_runtime

    return build_runtime


def sql_loop(ready: Path) -> None:
    """The bridge's per-task SQL without Celery (``python3 -m benchkit.records READY
    RECORDS``, configured by ``BRIDGE_*``): a poll's lease, each message's worth of tasks
    run in process as a worker runs them, until a poll leases nothing. No broker, no
    message, no process hop: the bridge through Celery can approach it, not pass it.

    Started, it connects (one empty poll), touches ``ready``, waits for a line on stdin,
    drains, then waits for stdin to close, so the bench reads its CPU while it lives."""
    from bridge.config import current_settings
    from bridge.engine import Batch, poll_once

    rt = build_runtime()(current_settings())

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
