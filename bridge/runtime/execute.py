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
from dataclasses import replace

from bridge.celery import app
from bridge.handlers.api import TaskContext
from bridge.handlers.outcome import HandlerResult, policy, run_handler
from bridge.phorge.php import decode_data
from bridge.queue import Lease, Outcome, Task
from bridge.queue.retry import DatabaseUnavailable
from bridge.runtime.context import Runtime, runtime
from bridge.runtime.metrics import DURATION, OUTCOMES, RENEWALS

log = logging.getLogger(__name__)


def backoff(rt: Runtime, failure_count: int) -> int:
    """Exponential wait with jitter for native handlers (Phorge's flat 300 s otherwise)."""
    settings = rt.settings
    wait = min(settings.retry_max, settings.retry_base * 2 ** min(failure_count, 30))
    return int(wait * (1 + random.uniform(0, settings.retry_jitter)))


def context(task: Task) -> TaskContext:
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
    )


def run_task(rt: Runtime, lease: Lease, data_json: str | None = None) -> Outcome:
    """Execute one leased task end to end; returns what happened."""
    session = rt.queue.session
    task = session.held(lease, with_data=data_json is None)
    if task is None:
        return Outcome.LEASE_LOST
    if data_json is not None:
        task = _with_inline_data(task, data_json)
    handler = rt.registry.handler_for(task.taskClass)
    if handler is None:
        # Configuration changed since the poll: give the row back to whoever can run it.
        rt.queue.free_own([task.id], lease.owner)
        return Outcome.NOT_SERVED
    if task.dataError:
        return report(rt, lease, HandlerResult(Outcome.PERMANENT_FAILURE, reason=task.dataError))
    ctx = context(task)
    limit = policy(handler.maximum_retry_count, ctx)
    if limit is not None and task.failureCount > limit:
        reason = f"{task.label} has exceeded the maximum number of failures ({limit})"
        return report(rt, lease, HandlerResult(Outcome.PERMANENT_FAILURE, reason=reason))

    required = policy(handler.required_lease, ctx)
    remaining = (task.leaseExpires or 0) - (task.serverTime or 0)
    if required is not None and remaining < required:
        claimed = session.renew(lease, required)
        RENEWALS.labels(result="renewed" if claimed else "lost").inc()
        if not claimed:
            return Outcome.LEASE_LOST
        remaining = required
    budget = required or rt.settings.default_lease
    with rt.keeper.watch(lease, task.label, remaining, budget) as watch:
        result = run_handler(handler, ctx)
    DURATION.labels(task_class=task.taskClass).observe(result.duration_us / 1e6)
    if watch.lost:
        return Outcome.LEASE_LOST
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
) -> Outcome:
    """Write the outcome with its guarded statement; a lost fence writes nothing."""
    session = rt.queue.session
    try:
        match result.outcome:
            case Outcome.SUCCESS:
                written = session.complete(lease, result.duration_us, result.followups)
            case Outcome.PERMANENT_FAILURE:
                written = session.fail_permanent(lease)
                if written:
                    log.warning("task %d failed permanently: %s", lease.task_id, result.reason)
            case Outcome.YIELD:
                written = session.yield_(lease, result.delay or 0)
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
        return Outcome.UNREPORTED
    return result.outcome if written else Outcome.LEASE_LOST


@app.task(name="bridge.execute", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def execute(
    task_id: int,
    owner: str,
    failure_count: int,
    data: str | None = None,
    taskClass: str | None = None,
    repoll: bool = False,
) -> str:
    """Run Phorge task ``task_id`` under its dispatch lease (``data``: its JSON, when small).

    ``repoll`` marks the middle of a full dispatch: once it has run, half the queue's
    capacity is free again, so the poller is asked to fill it now, not at the next beat.
    """
    rt = runtime()
    try:
        outcome = run_task(rt, Lease(task_id, owner, failure_count), data)
    except DatabaseUnavailable as exc:
        log.error("task %d: database unavailable (%s); the lease will expire", task_id, exc)
        outcome = Outcome.UNREPORTED
    finally:
        if repoll:
            from bridge.runtime.poller import poll

            poll.apply_async()
    OUTCOMES.labels(task_class=taskClass or "unknown", outcome=outcome.value).inc()
    label = f"{taskClass}#{task_id}" if taskClass else f"#{task_id}"
    log.info("%s: %s", label, outcome)
    return f"{label}: {outcome}"
