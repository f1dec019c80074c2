"""EVERY use of the bridge's Python API by the bench is in this file, and only here.

It uses the engine's public seams only: ``bridge.engine.run.observe`` for the run
timings, and the engine's ``Batch`` and the queue's lease for the SQL loop. They are
imported inside the functions, so the bench's other parts (the reference taskmaster,
the ceilings, the report) run without the bridge installed.

The bench otherwise treats the bridge as a black box: ``celery -A bridge beat`` and
``celery -A bridge worker``, configured by ``BRIDGE_*`` variables, and the Celery task
names below (part of the bridge's public contract: Flower shows them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CELERY_APP = "bridge"  # celery -A bridge
POLL_TASK = "bridge.poll"
RUN_RECORD = "bridge.run"  # one Phorge task's run, recorded through observe_runs
DEFAULT_POLL_INTERVAL = "0.25"  # BRIDGE_POLL_INTERVAL's default (docs/settings.md)


@dataclass(frozen=True)
class LeasedTask:
    id: int
    owner: str
    failure_count: int
    raw_data: str | None


@dataclass(frozen=True)
class SqlPath:
    """The bridge's per-task SQL without Celery: its lease query and its execute path."""

    batch: int  # the default max in flight of the default queue: what one poll leases
    lease: Callable[[int], list[LeasedTask]]
    execute: Callable[[list[LeasedTask]], list[str]]  # each task's outcome


def sql_path() -> SqlPath:
    """The bridge's lease and execute functions, configured from the ``BRIDGE_*`` env."""
    from bridge.engine.batch import Batch
    from bridge.engine.context import runtime
    from bridge.engine.poll import batch_size
    from bridge.queue.model import Leased

    rt = runtime()
    settings = rt.settings

    def lease(limit: int) -> list[LeasedTask]:
        # As a poll does: the classes present, then the dispatch lease.
        owner, tasks = rt.queue.lease_to_send(
            limit,
            settings.owner_prefix,
            settings.dispatch_lease,
            rt.queue.task_classes(),
            settings.inline_data_max,
        )
        return [LeasedTask(t.id, owner, t.failure_count, t.data) for t in tasks]

    def execute(tasks: list[LeasedTask]) -> list[str]:
        # As a dispatch sends them: the fence and the data inline, a message's worth at a
        # time (a lease of the whole capacity), each message's tasks run as a worker does.
        size = batch_size(len(tasks), settings.batch_max)
        outcomes = []
        for at in range(0, len(tasks), size):
            group = tasks[at : at + size]
            batch = Batch(rt, group[0].owner, None)
            batch.run([Leased(t.id, t.failure_count, None, t.raw_data) for t in group])
            outcomes += [str(ran.outcome) for _, ran, _ in batch.ran]
        return outcomes

    batch = settings.max_inflight.for_queue(settings.router.default_queue)
    return SqlPath(batch, lease, execute)


def observe_runs(started: Callable[[int], None], ended: Callable[[int], None]) -> None:
    """Call ``started(id)`` as each Phorge task's run begins (its lease checked) and
    ``ended(id)`` once its outcome is written: a Celery message may carry several.
    Through the engine's public observer hook."""
    from bridge.engine.run import RunObserver, observe

    class Timing(RunObserver):
        def run_started(self, lease: Any) -> None:
            started(lease.task_id)

        def run_ended(self, item: Any, ran: Any) -> None:
            ended(item.id)

    observe(Timing())
