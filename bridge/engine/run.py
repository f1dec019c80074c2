"""One group's run: a message's consecutive tasks, cut for one handler call.

Each checked task is prepared in the order of ``PhabricatorWorkerActiveTask::
executeTask`` (apply the maximum retry count, make sure the lease covers the run:
:func:`prepare`, giving a :class:`ClearedTask`), then the cleared ones run, a handler
call at a time (:func:`run_cleared`), and each run is handed on as it ends: with an
outcome to write under the lease (:class:`PendingOutcome`), or with nothing left to
write (:class:`RunReport`). Which side of a canary runs it is
``bridge.engine.sides``'; checking and writing are the batch's part
(``bridge.engine.batch``); sending and receiving messages is Celery's
(``bridge.runtime``), so this module knows nothing of either.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack

from bridge.canary.weights import Canary
from bridge.engine.context import Runtime
from bridge.engine.observers import observers
from bridge.engine.reports import CheckedTask, ClearedTask, Ended, PendingOutcome, RunReport
from bridge.engine.sides import PHD_SHARE, fallback, side_of
from bridge.engine.tracing import traced
from bridge.handlers.api import TaskContext
from bridge.handlers.capabilities import (
    BatchHandler,
    availability_of,
    implementation_of,
    runs_together,
)
from bridge.handlers.outcome import HandlerResult, clear, run_handler, run_handlers
from bridge.queue import Lease, Outcome, Task

LEASE_EXPIRED = "the lease expired while the handler ran"


def run_group(
    rt: Runtime, group: Sequence[CheckedTask], traceparent: str | None, canary: Canary
) -> list[tuple[CheckedTask, Ended]]:
    """Prepare a group's checked tasks, then run the cleared ones, a handler call at a
    time; each task with how it ended: those that ended before their run first, then the
    others in the order of their calls. The batch stages them all once the group is
    done, as it writes them only then (with the next group's check)."""
    ended: list[tuple[CheckedTask, Ended]] = []
    cleared: list[tuple[CheckedTask, ClearedTask]] = []
    for checked in group:
        with traced(checked.trace):
            prepared = prepare(rt, checked.lease, checked.task, traceparent, canary)
        if isinstance(prepared, ClearedTask):
            cleared.append((checked, prepared))
        else:
            ended.append((checked, prepared))
    for calls in handler_calls(cleared):
        with traced(calls[0][0].trace):
            runs = run_cleared(rt, [run for _, run in calls])
        ended += zip([checked for checked, _ in calls], runs, strict=True)
    return ended


def handler_calls(
    cleared: Sequence[tuple[CheckedTask, ClearedTask]],
) -> list[list[tuple[CheckedTask, ClearedTask]]]:
    """Cleared tasks cut into handler calls: consecutive ones of one handler that runs
    several in one call (``runs_together``) share one, every other task has its own. A
    group is made before its check, which may send a task elsewhere (a canary's row
    that fell back goes to PHP), so the handler each one actually got decides."""
    calls: list[list[tuple[CheckedTask, ClearedTask]]] = []
    for entry in cleared:
        handler = entry[1].handler
        if calls and calls[-1][0][1].handler is handler and runs_together(handler):
            calls[-1].append(entry)
        else:
            calls.append([entry])
    return calls


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


def prepare(
    rt: Runtime,
    lease: Lease,
    task: Task | None,
    traceparent: str | None,
    canary: Canary,
) -> Ended | ClearedTask:
    """Everything before a task's run that its check found (``task``, None when the lease
    no longer held): ended already (an :data:`Ended`) or cleared to run. ``canary``: the
    weights the batch read for its message."""
    for observer in observers():
        observer.run_started(lease)
    if task is None:
        return RunReport(Outcome.LEASE_LOST, "the lease was no longer held before the run")
    choice = side_of(rt.registry, canary, task, rt.settings.canary_max_yielding)
    remaining = (task.lease_expires or 0) - (task.server_time or 0)
    if choice.back_to_phd:
        # Rolled back, or its weight lowered, since the poll: phd's daemon takes it.
        back = HandlerResult(Outcome.HANDED_BACK, reason=PHD_SHARE)
        return PendingOutcome(lease, back, time.monotonic() + remaining)
    handler = choice.handler
    if handler is None:
        # Configuration changed since the poll: give the row back to whoever can run it.
        rt.queue.free_own([task.id], lease.owner)
        return RunReport(Outcome.NOT_SERVED, "no handler serves this class here; lease handed back")
    implementation = choice.implementation
    availability = availability_of(handler)
    if availability is not None and not availability.allow():
        # Its transport is down in this worker (PHP cannot boot, Conduit is unreachable):
        # the row goes back at once, for a worker that can run it, not into a yield that
        # would hold it for 5 s and starve the fleet's pace (issue 31).
        back = HandlerResult(Outcome.HANDED_BACK, reason=f"held back: {availability.reason}")
        back = fallback(choice.fallback_to, back)
        return PendingOutcome(lease, back, time.monotonic() + remaining, None, implementation)
    if task.data_error:
        failed = HandlerResult(Outcome.PERMANENT_FAILURE, reason=task.data_error)
        return PendingOutcome(lease, failed, time.monotonic() + remaining, None, implementation)
    ctx = context(task, lease, traceparent)
    cleared = clear(handler, ctx)
    if isinstance(cleared, HandlerResult):
        return PendingOutcome(lease, cleared, time.monotonic() + remaining, None, implementation)
    required = cleared.required_lease
    if required is not None:  # as PHP's setLeaseDuration(): set, shorter or longer
        claimed = rt.queue.session.renew(lease, required)
        for observer in observers():
            observer.lease_renewed("renewed" if claimed else "lost")
        if not claimed:
            return RunReport(
                Outcome.LEASE_LOST,
                "the lease was lost while claiming the required lease",
                implementation=implementation,
            )
        remaining = required
    budget = required or rt.settings.default_lease
    return ClearedTask(
        lease,
        task.label,
        handler,
        ctx,
        remaining,
        budget,
        implementation,
        choice.fallback_to,
        choice.yield_loop_age,
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
    implementation = implementation_of(handler)
    ended: list[Ended] = []
    for cleared, result, watch in zip(group, results, watches, strict=True):
        if watch.lost and cleared.fallback_to is not None:
            # A new-side run that outlived its lease falls back (while nobody took the row
            # meanwhile: the write is fenced on the owner), else it would go back to the
            # side that could not finish it; any other run's row waits for its expiry.
            duration = result.duration_us
            result = HandlerResult(Outcome.HANDED_BACK, reason=LEASE_EXPIRED, duration_us=duration)
        result = fallback(cleared.fallback_to, result, cleared.yield_loop_age)
        for observer in observers():
            observer.handler_returned(cleared.ctx.task_class, share, result, implementation)
        if watch.lost and result.outcome is not Outcome.FALLBACK:
            report = RunReport(Outcome.LEASE_LOST, LEASE_EXPIRED, implementation=implementation)
            ended.append(report)
        else:
            ended.append(
                PendingOutcome(
                    cleared.lease,
                    result,
                    watch.expires,
                    cleared.ctx,
                    cleared.implementation,
                    handler,
                )
            )
    return ended
