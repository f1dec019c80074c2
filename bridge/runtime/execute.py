"""``bridge.execute`` and ``bridge.execute_batch``: run leased Phorge tasks and write
their outcomes, fenced by their leases.

The order follows ``PhabricatorWorkerActiveTask::executeTask``: check the lease, apply
the maximum retry count, make sure the lease covers the run, run, then archive (result
0 or 1), yield, or count a temporary failure. A lease lost at any point means nothing
is written. A task costs two round trips, the check (one read) and its outcome (one
transaction); in a batch, an outcome travels with the next task's check.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery.exceptions import Retry
from celery.signals import task_postrun, task_prerun

from bridge.celery import app
from bridge.handlers.api import TaskContext
from bridge.handlers.outcome import HandlerResult, policy, run_handler
from bridge.queue import Lease, Outcome, Task
from bridge.queue.model import Leased
from bridge.queue.retry import DatabaseUnavailable
from bridge.queue.session import (
    Write,
    permanent_failure,
    success,
    temporary_failure,
    yielded,
)
from bridge.runtime.context import Runtime, runtime
from bridge.runtime.dispatch import EXECUTE_BATCH, EXECUTE_TASK, send
from bridge.runtime.metrics import RENEWALS, outcome_counter, run_timers
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


class BatchNotDone(TaskNotDone):
    """A batch in which some task did not succeed (or yield): each one's line follows."""


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


@dataclass(frozen=True)
class Done:
    """A run whose outcome is ready to be written under its lease."""

    lease: Lease
    result: HandlerResult
    ctx: TaskContext | None = None


def attempt(
    rt: Runtime,
    lease: Lease,
    task: Task | None,
    traceparent: str | None = None,
) -> Ran | Done:
    """Run a task its check found (``task``, None when the lease no longer held); returns
    how the run ended, final (``Ran``) or with an outcome to write (``Done``)."""
    if task is None:
        return Ran(Outcome.LEASE_LOST, "the lease was no longer held before the run")
    handler = rt.registry.handler_for(task.taskClass)
    if handler is None:
        # Configuration changed since the poll: give the row back to whoever can run it.
        rt.queue.free_own([task.id], lease.owner)
        return Ran(Outcome.NOT_SERVED, "no handler serves this class here; lease handed back")
    if task.dataError:
        return Done(lease, HandlerResult(Outcome.PERMANENT_FAILURE, reason=task.dataError))
    ctx = context(task, traceparent)
    limit = policy(handler.maximum_retry_count, ctx)
    if limit is not None and task.failureCount > limit:
        reason = f"{task.label} has exceeded the maximum number of failures ({limit})"
        return Done(lease, HandlerResult(Outcome.PERMANENT_FAILURE, reason=reason))

    # As PHP's setLeaseDuration(): a declared lease is set, shorter or longer.
    required = policy(handler.required_lease, ctx)
    remaining = (task.leaseExpires or 0) - (task.serverTime or 0)
    if required is not None:
        claimed = rt.queue.session.renew(lease, required)
        RENEWALS.labels(result="renewed" if claimed else "lost").inc()
        if not claimed:
            return Ran(Outcome.LEASE_LOST, "the lease was lost while claiming the required lease")
        remaining = required
    budget = required or rt.settings.default_lease
    started = time.perf_counter()
    with rt.keeper.watch(lease, task.label, remaining, budget) as watch:
        result = run_handler(handler, ctx)
    wall_time, duration = run_timers(task.taskClass)
    wall_time.observe(time.perf_counter() - started)
    duration.observe(result.duration_us / 1e6)
    if watch.lost:
        return Ran(Outcome.LEASE_LOST, "the lease expired while the handler ran")
    return Done(lease, result, ctx)


def retry_wait(rt: Runtime, ctx: TaskContext, declared: int | None) -> int:
    """The wait after a temporary failure: the one declared, else the backoff."""
    return declared if declared is not None else backoff(rt, ctx.failure_count)


@dataclass(frozen=True)
class Finished:
    """A finished run and its guarded write (None: a success with follow-ups, which is
    written on its own with their ids), waiting to be written."""

    item: Leased
    done: Done
    write: Write | None
    wait: int | None

    @classmethod
    def of(cls, rt: Runtime, item: Leased, done: Done) -> Finished:
        lease, result = done.lease, done.result
        wait = None
        match result.outcome:
            case Outcome.SUCCESS:
                write = None if result.followups else success(lease, result.duration_us)
            case Outcome.PERMANENT_FAILURE:
                write = permanent_failure(lease)
            case Outcome.YIELD:
                wait = result.delay or 0
                write = yielded(lease, wait)
            case _:
                assert done.ctx is not None
                wait = retry_wait(rt, done.ctx, result.delay)
                write = temporary_failure(lease, wait)
        return cls(item, done, write, wait)

    def write_alone(self, rt: Runtime) -> bool:
        session, lease, result = rt.queue.session, self.done.lease, self.done.result
        if self.write is None:
            return session.complete(lease, result.duration_us, result.followups)
        return session.apply([self.write])[0]

    def verdict(self, written: bool | Exception) -> Ran:
        """How the run ended, once its outcome's write was tried."""
        result, task_id = self.done.result, self.done.lease.task_id
        if isinstance(written, Exception):
            log.error(
                "task %d: outcome %s not written; the lease will expire (%s)",
                task_id,
                result.outcome,
                written,
                exc_info=None if isinstance(written, DatabaseUnavailable) else written,
            )
            return Ran(Outcome.UNREPORTED, f"{result.outcome} not written: {written}")
        if not written:
            return Ran(Outcome.LEASE_LOST, f"{result.outcome} not written: the lease was lost")
        if result.outcome is Outcome.PERMANENT_FAILURE:
            log.warning("task %d failed permanently: %s", task_id, result.reason)
        return Ran(result.outcome, result.reason, self.wait)


class Batch:
    """Runs leased tasks of one owner in order, each checked just before it runs.

    A task's outcome is written, in its own committed transaction, in the round trip
    that checks the next task: a batch costs one round trip a task, plus one for the
    last outcome, and nothing runs before the outcome of the task before it is durable.
    """

    def __init__(self, rt: Runtime, owner: str, traceparent: str | None) -> None:
        self.rt, self.owner, self.traceparent = rt, owner, traceparent
        self.pending: Finished | None = None
        self.ran: list[tuple[Leased, Ran, str]] = []  # and each one's line

    def run(self, items: Sequence[Leased], budget: float | None = None) -> list[Leased]:
        """Run ``items``; once ``budget`` seconds have passed, the rest is returned unrun."""
        started = time.monotonic()
        for index, item in enumerate(items):
            if index and budget is not None and time.monotonic() - started >= budget:
                self.flush()
                return list(items[index:])
            try:
                self.step(item)
            except DatabaseUnavailable as exc:
                reason = f"database unavailable ({exc}); the lease will expire"
                for left in items[index:]:
                    with traced(self.trace(left)):
                        self.record(left, Ran(Outcome.UNREPORTED, reason))
                return []
        self.flush()
        return []

    def trace(self, item: Leased) -> TaskTrace:
        return TaskTrace(item.id, item.task_class, self.owner, self.traceparent or "")

    def step(self, item: Leased) -> None:
        lease = Lease(item.id, self.owner, item.failure_count)
        with traced(self.trace(item)):
            ran = attempt(self.rt, lease, self.check(item, lease), self.traceparent)
            if isinstance(ran, Ran):
                self.record(item, ran)
                return
            try:
                self.pending = Finished.of(self.rt, item, ran)
            except ValueError as exc:  # a duration or wait out of Phorge's range
                self.record(item, Finished(item, ran, None, None).verdict(exc))
                return
            if self.pending.write is None:
                self.flush()

    def check(self, item: Leased, lease: Lease) -> Task | None:
        """The check of ``lease``, sharing its round trip with the pending outcome."""
        session = self.rt.queue.session
        if self.pending is None:
            return session.held(lease, item.data)
        assert self.pending.write is not None
        try:
            written, task = session.write_then_check([self.pending.write], lease, item.data)
        except DatabaseUnavailable as exc:
            self.settle(exc)
            raise
        except Exception:
            # The server refused the pending outcome: it is tried, and fails, alone.
            self.flush()
            return session.held(lease, item.data)
        self.settle(written[0])
        return task

    def settle(self, written: bool | Exception) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            with traced(self.trace(pending.item)):
                self.record(pending.item, pending.verdict(written))

    def record(self, item: Leased, ran: Ran) -> None:
        """Count and log how a task's run ended (under its trace)."""
        outcome_counter(item.task_class or "unknown", ran.outcome.value).inc()
        line = ran.describe(item.label)
        log.info("%s", line)
        self.ran.append((item, ran, line))

    def flush(self) -> None:
        """Write the pending outcome on its own."""
        if self.pending is None:
            return
        try:
            written: bool | Exception = self.pending.write_alone(self.rt)
        except Exception as exc:
            written = exc
        self.settle(written)


def run_task(
    rt: Runtime,
    lease: Lease,
    data_json: str | None = None,
    traceparent: str | None = None,
    task_class: str | None = None,
) -> Ran:
    """Execute one leased task end to end; returns what happened."""
    batch = Batch(rt, lease.owner, traceparent)
    batch.run([Leased(lease.task_id, lease.failure_count, task_class, data_json)])
    return batch.ran[0][1]


def trace_of(request: Any, args: tuple, kwargs: dict) -> TaskTrace:
    """The trace of a ``bridge.execute`` message: its sender's traceparent, or a new one."""
    return TaskTrace(
        task_id=args[0],
        task_class=kwargs.get("taskClass"),
        owner=args[1],
        traceparent=traceparent_or_new(request.get(TRACEPARENT_HEADER)),
    )


BATCH_DONE = (Outcome.SUCCESS, Outcome.YIELD)


def _repoll() -> None:
    from bridge.runtime.poller import poll

    poll.apply_async()


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
    item = Leased(task_id, failure_count, taskClass, data)
    trace = current_trace() or trace_of(self.request, (task_id, owner), {"taskClass": taskClass})
    batch = Batch(runtime(), owner, trace.traceparent)
    try:
        batch.run([item])
    finally:
        if repoll:
            _repoll()
    _, ran, line = batch.ran[0]
    if ran.outcome is Outcome.SUCCESS:
        return line
    if ran.outcome is Outcome.YIELD:
        raise Retry(line, exc=TaskYielded(line), when=ran.wait)
    raise NOT_DONE[ran.outcome](line)


@app.task(
    name=EXECUTE_BATCH,
    bind=True,
    ignore_result=True,
    throws=(TaskNotDone,),
)
def execute_batch(self, owner: str, tasks: list[list[Any]], repoll: bool = False) -> str:
    """Run the tasks of a backlog's batch in order (each ``[id, failureCount, class,
    data]``, leased by ``owner``); see :func:`execute` for ``repoll``.

    Once the batch has run for a poll interval, the tasks left are sent on, as many a
    message as ran in that time, so long tasks spread over the workers. Returns a
    summary when every task succeeded or yielded, else raises :class:`BatchNotDone`,
    whose message has the line of each task that did not.
    """
    rt = runtime()
    items = [Leased(*task) for task in tasks]
    traceparent = traceparent_or_new(self.request.get(TRACEPARENT_HEADER))
    batch = Batch(rt, owner, traceparent)
    started = time.monotonic()
    try:
        rest = batch.run(items, budget=rt.settings.poll_interval)
        if rest:
            pace = (time.monotonic() - started) / len(batch.ran)
            size = max(1, min(len(rest), int(rt.settings.poll_interval / pace)))
            queue = rt.settings.router.queue_for(rest[0].task_class or "")
            sent = send(owner, rest, queue, size)
            if sent < len(rest):
                rt.queue.free_own([item.id for item in rest[sent:]], owner)
    finally:
        if repoll:
            _repoll()
    counts = Counter(ran.outcome.value for _, ran, _ in batch.ran)
    summary = f"{len(batch.ran)} task(s): " + ", ".join(
        f"{n} {name}" for name, n in sorted(counts.items())
    )
    not_done = [line for _, ran, line in batch.ran if ran.outcome not in BATCH_DONE]
    if rest:
        summary += f"; {len(rest)} sent on"
    if not_done:
        raise BatchNotDone("; ".join([summary, *not_done]))
    return summary


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
