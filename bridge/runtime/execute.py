"""``bridge.execute``: run one leased Phorge task and write its outcome, fenced by its lease.

The order follows ``PhabricatorWorkerActiveTask::executeTask``: check the lease, apply
the maximum retry count, make sure the lease covers the run, run, then archive (result
0 or 1), yield, or count a temporary failure. A lease lost at any point means nothing
is written. A short task costs two round trips: the check (one read) and its outcome
(one transaction).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace
from typing import Any

from celery.exceptions import Retry
from celery.signals import task_postrun, task_prerun

from bridge.celery import app
from bridge.handlers.api import TaskContext
from bridge.handlers.outcome import HandlerResult, policy, run_handler
from bridge.phorge.php import decode_data
from bridge.queue import Lease, Outcome, Task
from bridge.queue.retry import DatabaseUnavailable
from bridge.runtime.context import Runtime, runtime
from bridge.runtime.metrics import DURATION, OUTCOMES, RENEWALS, WALL_TIME
from bridge.runtime.tracing import (
    TRACEPARENT_HEADER,
    TaskTrace,
    begin_trace,
    current_trace,
    end_trace,
    traced,
    traceparent_or_new,
)

log = logging.getLogger(__name__)

EXECUTE_TASK = "bridge.execute"


@dataclass(frozen=True)
class Ran:
    """How one execution ended: the outcome written (or why none was), the handler's
    reason and, for a failure or a yield, the seconds until the task is due again."""

    outcome: Outcome
    reason: str = ""
    wait: int | None = None

    def describe(self, label: str) -> str:
        """One line, the same in the worker log, Flower and ``phorge-bridge execute``."""
        text = f"{label}: {self.outcome}"
        if self.reason:
            text += f": {self.reason}"
        if self.wait is not None:
            text += f" (due again in {self.wait} s)"
        return text


class TaskNotDone(Exception):
    """A run that did not end in success, raised so Celery and Flower record a FAILURE.

    Expected (the task's ``throws``): logged in one line without a traceback, and the
    message is acked; the bridge, from the database, decides whether the task runs again.
    """


class TaskFailed(TaskNotDone):
    """A temporary failure: the bridge runs the task again after its wait."""


class TaskFailedPermanently(TaskNotDone):
    """A permanent failure: archived with result 1."""


class LeaseLost(TaskNotDone):
    """The lease was no longer this run's: nothing was written."""


class TaskNotServed(TaskNotDone):
    """No handler serves the class here any more: the lease was handed back."""


class OutcomeUnreported(TaskNotDone):
    """The database stayed unreachable: the lease will expire and the task run again."""


class TaskYielded(TaskNotDone):
    """A yield, raised inside Celery's ``Retry``: the RETRY state (Flower shows it apart
    from successes and failures), though Celery sends nothing again: the poller leases
    the row once the yield is over."""


NOT_DONE: dict[Outcome, type[TaskNotDone]] = {
    Outcome.FAILURE: TaskFailed,
    Outcome.PERMANENT_FAILURE: TaskFailedPermanently,
    Outcome.LEASE_LOST: LeaseLost,
    Outcome.NOT_SERVED: TaskNotServed,
    Outcome.UNREPORTED: OutcomeUnreported,
}


def backoff(rt: Runtime, failure_count: int) -> int:
    """Exponential wait with jitter for native handlers of classes Phorge does not have."""
    settings = rt.settings
    wait = min(settings.retry_max, settings.retry_base * 2 ** min(failure_count, 30))
    return int(wait * (1 + random.uniform(0, settings.retry_jitter)))


def context(task: Task, traceparent: str | None = None) -> TaskContext:
    """What the handler sees of the task."""
    return TaskContext(
        id=task.id,
        task_class=task.taskClass,
        data=task.data,
        failure_count=task.failureCount,
        priority=task.priority,
        object_phid=task.objectPHID,
        container_phid=task.containerPHID,
        raw_data=task.rawData,
        traceparent=traceparent,
    )


def run_task(
    rt: Runtime, lease: Lease, data_json: str | None = None, traceparent: str | None = None
) -> Ran:
    """Execute one leased task end to end; returns what happened."""
    session = rt.queue.session
    task = session.held(lease, with_data=data_json is None)
    if task is None:
        return Ran(Outcome.LEASE_LOST, "the lease was no longer held before the run")
    if data_json is not None:
        task = _with_inline_data(task, data_json)
    handler = rt.registry.handler_for(task.taskClass)
    if handler is None:
        # Configuration changed since the poll: give the row back to whoever can run it.
        rt.queue.free_own([task.id], lease.owner)
        return Ran(Outcome.NOT_SERVED, "no handler serves this class here; lease handed back")
    if task.dataError:
        return report(rt, lease, HandlerResult(Outcome.PERMANENT_FAILURE, reason=task.dataError))
    ctx = context(task, traceparent)
    limit = policy(handler.maximum_retry_count, ctx)
    if limit is not None and task.failureCount > limit:
        reason = f"{task.label} has exceeded the maximum number of failures ({limit})"
        return report(rt, lease, HandlerResult(Outcome.PERMANENT_FAILURE, reason=reason))

    # As PHP's setLeaseDuration(): a declared lease is set, shorter or longer.
    required = policy(handler.required_lease, ctx)
    remaining = (task.leaseExpires or 0) - (task.serverTime or 0)
    if required is not None:
        claimed = session.renew(lease, required)
        RENEWALS.labels(result="renewed" if claimed else "lost").inc()
        if not claimed:
            return Ran(Outcome.LEASE_LOST, "the lease was lost while claiming the required lease")
        remaining = required
    budget = required or rt.settings.default_lease
    started = time.perf_counter()
    with rt.keeper.watch(lease, task.label, remaining, budget) as watch:
        result = run_handler(handler, ctx)
    WALL_TIME.labels(task_class=task.taskClass).observe(time.perf_counter() - started)
    DURATION.labels(task_class=task.taskClass).observe(result.duration_us / 1e6)
    if watch.lost:
        return Ran(Outcome.LEASE_LOST, "the lease expired while the handler ran")
    return report(rt, lease, result, ctx)


def _with_inline_data(task: Task, data_json: str) -> Task:
    data, error = decode_data(data_json)
    return replace(task, data=data, rawData=data_json, dataError=error)


def retry_wait(rt: Runtime, ctx: TaskContext, declared: int | None) -> int:
    """The wait after a temporary failure: the one declared, else the backoff."""
    return declared if declared is not None else backoff(rt, ctx.failure_count)


def report(
    rt: Runtime,
    lease: Lease,
    result: HandlerResult,
    ctx: TaskContext | None = None,
) -> Ran:
    """Write the outcome with its guarded statement; a lost fence writes nothing."""
    session = rt.queue.session
    wait = None
    try:
        match result.outcome:
            case Outcome.SUCCESS:
                written = session.complete(lease, result.duration_us, result.followups)
            case Outcome.PERMANENT_FAILURE:
                written = session.fail_permanent(lease)
                if written:
                    log.warning("task %d failed permanently: %s", lease.task_id, result.reason)
            case Outcome.YIELD:
                wait = result.delay or 0
                written = session.yield_(lease, wait)
            case _:
                assert ctx is not None
                wait = retry_wait(rt, ctx, result.delay)
                written = session.fail_temporary(lease, wait)
    except DatabaseUnavailable as exc:
        log.error(
            "task %d: outcome %s not written; the lease will expire (%s)",
            lease.task_id,
            result.outcome,
            exc,
        )
        return Ran(Outcome.UNREPORTED, f"{result.outcome} not written: {exc}")
    if not written:
        return Ran(Outcome.LEASE_LOST, f"{result.outcome} not written: the lease was lost")
    return Ran(result.outcome, result.reason, wait)


def trace_of(request: Any, args: tuple, kwargs: dict) -> TaskTrace:
    """The trace of a ``bridge.execute`` message: its sender's traceparent, or a new one."""
    return TaskTrace(
        task_id=args[0],
        task_class=kwargs.get("taskClass"),
        owner=args[1],
        traceparent=traceparent_or_new(request.get(TRACEPARENT_HEADER)),
    )


@app.task(
    name=EXECUTE_TASK,
    bind=True,
    ignore_result=True,
    throws=(TaskNotDone,),
)
def execute(
    self,
    task_id: int,
    owner: str,
    failure_count: int,
    data: str | None = None,
    taskClass: str | None = None,
    repoll: bool = False,
) -> str:
    """Run Phorge task ``task_id`` under its dispatch lease (``data``: its JSON, when small).

    Returns ``'Class#id: success'``; any other outcome raises a :class:`TaskNotDone`
    (a yield inside a ``Retry``), so Celery's state is the outcome's. ``repoll`` marks the
    middle of a full dispatch: once it has run, half the queue's capacity is free again,
    so the poller is asked to fill it now, not at the next beat.
    """
    args = (task_id, owner, failure_count)
    trace = current_trace() or trace_of(self.request, args, {"taskClass": taskClass})
    with traced(trace):
        rt = runtime()
        try:
            ran = run_task(rt, Lease(*args), data, trace.traceparent)
        except DatabaseUnavailable as exc:
            ran = Ran(Outcome.UNREPORTED, f"database unavailable ({exc}); the lease will expire")
        finally:
            if repoll:
                from bridge.runtime.poller import poll

                poll.apply_async()
        OUTCOMES.labels(task_class=taskClass or "unknown", outcome=ran.outcome.value).inc()
        label = f"{taskClass}#{task_id}" if taskClass else f"#{task_id}"
        line = ran.describe(label)
        log.info("%s", line)
    if ran.outcome is Outcome.SUCCESS:
        return line
    if ran.outcome is Outcome.YIELD:
        raise Retry(line, exc=TaskYielded(line), when=ran.wait)
    raise NOT_DONE[ran.outcome](line)


_trace_tokens: dict[str, Any] = {}


@task_prerun.connect(sender=execute)
def _begin_trace(task_id: str, task: Any, args: tuple, kwargs: dict, **_: Any) -> None:
    """Tag Celery's own lines about the run too (its "raised expected" or "succeeded")."""
    _trace_tokens[task_id] = begin_trace(trace_of(task.request, args, kwargs))


@task_postrun.connect(sender=execute)
def _end_trace(task_id: str, **_: Any) -> None:
    token = _trace_tokens.pop(task_id, None)
    if token is not None:
        end_trace(token)
