"""EVERY use of the bridge's internals by the bench is in this file, and only here.

The bridge package is being restructured; whoever moves ``bridge.queue``,
``bridge.runtime`` or changes ``run_task``/``lease`` updates the function below and
nothing else in ``scripts/``. They are imported lazily, inside the function, so the
bench's other parts (the reference taskmaster, the ceilings, the report) work even
while the bridge is broken mid-refactor.

The bench otherwise treats the bridge as a black box: ``celery -A bridge beat`` and
``celery -A bridge worker``, configured by ``BRIDGE_*`` variables, and the Celery task
names below (part of the bridge's public contract: Flower shows them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

CELERY_APP = "bridge"  # celery -A bridge
EXECUTE_TASK = "bridge.execute"  # its first argument is the Phorge task id
POLL_TASK = "bridge.poll"
DEFAULT_POLL_INTERVAL = "0.25"  # BRIDGE_POLL_INTERVAL's default (README, "Settings")


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
    execute: Callable[[LeasedTask], str]


def sql_path() -> SqlPath:
    """The bridge's lease and execute functions, configured from the ``BRIDGE_*`` env."""
    from bridge.queue import Lease
    from bridge.queue.model import new_owner
    from bridge.runtime.context import runtime
    from bridge.runtime.execute import run_task

    rt = runtime()
    settings = rt.settings

    def lease(limit: int) -> list[LeasedTask]:
        owner = new_owner(settings.owner_prefix)
        tasks = rt.queue.lease(limit, owner, settings.dispatch_lease)
        return [LeasedTask(t.id, t.leaseOwner, t.failureCount, t.rawData) for t in tasks]

    def execute(task: LeasedTask) -> str:
        # As a dispatched message carries it: the fence, and the data inline.
        fence = Lease(task.id, task.owner, task.failure_count)
        return str(run_task(runtime(), fence, task.raw_data))

    batch = settings.max_inflight.for_queue(settings.router.default_queue)
    return SqlPath(batch, lease, execute)
