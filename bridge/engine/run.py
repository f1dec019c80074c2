"""One leased task's run, in the order of ``PhabricatorWorkerActiveTask::executeTask``.

Check the lease, apply the maximum retry count, make sure the lease covers the run
(:func:`prepare`: a :class:`ClearedTask`), run (:func:`run_cleared`), and say how it
ended: with an outcome to write under the lease (:class:`PendingOutcome`), or with
nothing left to write (:class:`RunReport`, what callers are told). Writing is the batch's part
(``bridge.engine.batch``); sending and receiving messages is Celery's
(``bridge.runtime``), so this module knows nothing of either.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from bridge.engine.context import Runtime
from bridge.engine.observers import observers
from bridge.handlers.api import Handler, TaskContext
from bridge.handlers.capabilities import BatchHandler, availability_of
from bridge.handlers.outcome import HandlerResult, clear, run_handler, run_handlers
from bridge.queue import Lease, Outcome, Task


@dataclass(frozen=True)
class RunReport:
    """How one execution ended: the outcome written (or why none was), the handler's
    reason and, for a failure or a yield, the seconds until the task is due again; for a
    failure, what the handler raised (``HandlerResult.error``)."""

    outcome: Outcome
    reason: str = ""
    wait: int | None = None
    error: Exception | None = None

    def describe(self, label: str) -> str:
        """One line, the same in the worker log, Flower and ``phorge-bridge execute``."""
        text = f"{label}: {self.outcome}"
        if self.reason:
            text += f": {self.reason}"
        if self.wait is not None:
            text += f" (due again in {self.wait} s)"
        return text


@dataclass(frozen=True)
class PendingOutcome:
    """A run whose outcome is ready to be written under its lease, which runs out at
    ``expires`` (monotonic time): a refused write is tried again until then."""

    lease: Lease
    result: HandlerResult
    expires: float
    ctx: TaskContext | None = None


# A run that ended before its outcome was written: with one to write, or with none.
Ended = PendingOutcome | RunReport


def backoff(rt: Runtime, failure_count: int) -> int:
    """Exponential wait with jitter for native handlers of classes Phorge does not have."""
    settings = rt.settings
    wait = min(settings.retry_max, settings.retry_base * 2 ** min(failure_count, 30))
    return int(wait * (1 + random.uniform(0, settings.retry_jitter)))


def retry_wait(rt: Runtime, ctx: TaskContext, declared: int | None) -> int:
    """The wait after a temporary failure: the one declared, else the backoff."""
    return declared if declared is not None else backoff(rt, ctx.failure_count)


def context(task: Task, lease: Lease, traceparent: str | None = None) -> TaskContext:
    """What the handler sees of the task, and of the lease it runs under."""
    return TaskContext(
        id=task.id,
        task_class=task.task_class,
        data=task.data,
        failure_count=task.failure_count,
        priority=task.priority,
        object_phid=task.object_phid,
        container_phid=task.container_phid,
        raw_data=task.raw_data,
        traceparent=traceparent,
        lease_owner=lease.owner,
    )


@dataclass(frozen=True)
class ClearedTask:
    """A checked task cleared to run: its handler and context, the lease seconds it has
    left and the seconds its run may keep the lease renewed."""

    lease: Lease
    label: str
    handler: Handler
    ctx: TaskContext
    remaining: int
    budget: int


def prepare(
    rt: Runtime,
    lease: Lease,
    task: Task | None,
    traceparent: str | None = None,
) -> Ended | ClearedTask:
    """Everything before a task's run that its check found (``task``, None when the lease
    no longer held): ended already (an :data:`Ended`) or cleared to run."""
    for observer in observers():
        observer.run_started(lease)
    if task is None:
        return RunReport(Outcome.LEASE_LOST, "the lease was no longer held before the run")
    handler = rt.registry.handler_for(task.task_class)
    if handler is None:
        # Configuration changed since the poll: give the row back to whoever can run it.
        rt.queue.free_own([task.id], lease.owner)
        return RunReport(Outcome.NOT_SERVED, "no handler serves this class here; lease handed back")
    remaining = (task.lease_expires or 0) - (task.server_time or 0)
    availability = availability_of(handler)
    if availability is not None and not availability.allow():
        # Its transport is down in this worker (PHP cannot boot, Conduit is unreachable):
        # the row goes back at once, for a worker that can run it, not into a yield that
        # would hold it for 5 s and starve the fleet's pace (issue 31).
        back = HandlerResult(Outcome.HANDED_BACK, reason=f"held back: {availability.reason}")
        return PendingOutcome(lease, back, time.monotonic() + remaining)
    if task.data_error:
        failed = HandlerResult(Outcome.PERMANENT_FAILURE, reason=task.data_error)
        return PendingOutcome(lease, failed, time.monotonic() + remaining)
    ctx = context(task, lease, traceparent)
    cleared = clear(handler, ctx)
    if isinstance(cleared, HandlerResult):
        return PendingOutcome(lease, cleared, time.monotonic() + remaining)
    required = cleared.required_lease
    if required is not None:  # as PHP's setLeaseDuration(): set, shorter or longer
        claimed = rt.queue.session.renew(lease, required)
        for observer in observers():
            observer.lease_renewed("renewed" if claimed else "lost")
        if not claimed:
            return RunReport(
                Outcome.LEASE_LOST, "the lease was lost while claiming the required lease"
            )
        remaining = required
    return ClearedTask(
        lease, task.label, handler, ctx, remaining, required or rt.settings.default_lease
    )


def run_cleared(rt: Runtime, group: Sequence[ClearedTask]) -> list[Ended]:
    """Run tasks cleared to run, all of one handler: one ``run`` for one task, one
    ``run_batch`` for several; each lease is kept renewed while the call lasts."""
    handler = group[0].handler
    started = time.perf_counter()
    with ExitStack() as stack:
        watches = [
            stack.enter_context(rt.keeper.watch(r.lease, r.label, r.remaining, r.budget))
            for r in group
        ]
        if len(group) == 1:
            results = [run_handler(handler, group[0].ctx)]
        else:  # only a BatchHandler's tasks are grouped (``capabilities.runs_together``)
            assert isinstance(handler, BatchHandler)
            results = run_handlers(handler, [r.ctx for r in group])
    share = (time.perf_counter() - started) / len(group)
    ended: list[Ended] = []
    for cleared, result, watch in zip(group, results, watches, strict=True):
        for observer in observers():
            observer.handler_returned(cleared.ctx.task_class, share, result)
        if watch.lost:
            ended.append(RunReport(Outcome.LEASE_LOST, "the lease expired while the handler ran"))
        else:
            ended.append(PendingOutcome(cleared.lease, result, watch.expires, cleared.ctx))
    return ended
