"""``bridge.execute``: run one leased Phorge task and write its outcome, fenced by its owner.

The order follows ``PhabricatorWorkerActiveTask::executeTask``: check the lease, apply
the maximum retry count, make sure the lease covers the run, run, then archive (result
0 or 1), yield, or count a temporary failure. A lease lost at any point means nothing
is written.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from typing import TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError

from bridge.app import app
from bridge.handlers.base import (
    Handler,
    PermanentFailure,
    TaskContext,
    TemporaryFailure,
    Yield,
)
from bridge.metrics import DURATION, OUTCOMES, RENEWALS
from bridge.model import Task, decode_data
from bridge.queue import PhorgeQueue
from bridge.runtime import Runtime, runtime

log = logging.getLogger(__name__)
TRANSIENT = (OperationalError, InterfaceError)
T = TypeVar("T")


class Outcome(StrEnum):
    SUCCESS = "success"
    FAILURE = "failure"
    PERMANENT_FAILURE = "permanent-failure"
    YIELD = "yield"
    LEASE_LOST = "lease-lost"
    NOT_SERVED = "not-served"
    UNREPORTED = "unreported"


def backoff(rt: Runtime, failure_count: int) -> int:
    """Exponential wait with jitter for native handlers (Phorge's flat 300 s otherwise)."""
    settings = rt.settings
    wait = min(settings.retry_max, settings.retry_base * 2 ** min(failure_count, 30))
    return int(wait * (1 + random.uniform(0, settings.retry_jitter)))


class DatabaseUnavailable(Exception):
    """The database kept failing through every attempt."""


def with_retries(rt: Runtime, what: str, call: Callable[[], T]) -> T:
    """Run a guarded statement through database blips, with backoff, a bounded number of times."""
    attempts = rt.settings.report_attempts
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except TRANSIENT as exc:
            log.warning("%s: database error (attempt %d/%d): %s", what, attempt, attempts, exc)
            if attempt == attempts:
                raise DatabaseUnavailable(what) from exc
            time.sleep(min(0.2 * 2**attempt, 5.0))
    raise AssertionError("unreachable")


class Heartbeat:
    """Renews a running task's lease every third of it, within the run's lease budget."""

    def __init__(self, queue: PhorgeQueue, task: Task, length: int, budget: int) -> None:
        self.queue, self.task = queue, task
        self.length, self.budget = max(length, 3), budget
        self.lost = False
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{task.id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.length / 3):
            left = self.budget - int(time.monotonic() - self._started)
            if left <= 0:
                log.warning("%s ran past its lease budget; the lease will expire", self.task.label)
                return
            try:
                renewed = self.queue.renew(
                    self.task.id, self.task.leaseOwner, min(self.length, left)
                )
            except TRANSIENT as exc:
                RENEWALS.labels(result="error").inc()
                log.warning("%s: heartbeat failed, will retry: %s", self.task.label, exc)
                continue
            RENEWALS.labels(result="renewed" if renewed else "lost").inc()
            if not renewed:
                self.lost = True
                log.warning(
                    "%s: lease lost while running; its result will be dropped", self.task.label
                )
                return


def context(task: Task, data_json: str | None) -> tuple[TaskContext, str | None]:
    """What the handler sees; the second item is why the data cannot be used, if so."""
    raw = task.rawData if data_json is None else data_json
    data, error = decode_data(raw)
    ctx = TaskContext(
        id=task.id,
        taskClass=task.taskClass,
        data=data,
        failureCount=task.failureCount,
        priority=task.priority,
        objectPHID=task.objectPHID,
        containerPHID=task.containerPHID,
        leaseOwner=task.leaseOwner,
        rawData=raw,
    )
    return ctx, error


def policy(hook: Callable[[TaskContext], object], ctx: TaskContext) -> int | None:
    """A handler's policy answer (seconds, or a count) as an int; None means the default.

    A hook that raises or answers nonsense must not stop the run from being reported:
    the failure would go uncounted and the task would loop, lease after lease, forever.
    """
    try:
        value = hook(ctx)
        if value is None:
            return None
        if isinstance(value, bool) or int(value) < 0:
            raise ValueError(f"{value!r} is not a number of seconds or a count")
        return int(value)
    except Exception as exc:
        name = getattr(hook, "__name__", "policy")
        log.warning("%s#%d: %s: %s; using the default", ctx.taskClass, ctx.id, name, exc)
        return None


def run_task(rt: Runtime, task_id: int, owner: str, data_json: str | None = None) -> Outcome:
    """Execute one leased task end to end; returns what happened."""
    queue = rt.queue
    task = with_retries(
        rt, f"task {task_id}", lambda: queue.held(task_id, owner, data_json is None)
    )
    if task is None:
        return Outcome.LEASE_LOST
    handler = rt.registry.handler_for(task.taskClass)
    if handler is None:
        # Configuration changed since the poll: give the row back to whoever can run it.
        queue.free_own([task.id], owner)
        return Outcome.NOT_SERVED
    ctx, data_error = context(task, data_json)
    if data_error:
        return report(rt, task, Outcome.PERMANENT_FAILURE, data_error)
    limit = policy(handler.maximum_retry_count, ctx)
    if limit is not None and task.failureCount > limit:
        reason = f"{task.label} has exceeded the maximum number of failures ({limit})"
        return report(rt, task, Outcome.PERMANENT_FAILURE, reason)

    required = policy(handler.required_lease, ctx)
    remaining = (task.leaseExpires or 0) - (task.serverTime or 0)
    if required is not None and remaining < required:
        claimed = with_retries(rt, task.label, lambda: queue.renew(task.id, owner, required))
        RENEWALS.labels(result="renewed" if claimed else "lost").inc()
        if not claimed:
            return Outcome.LEASE_LOST
        remaining = required
    budget = required or rt.settings.default_lease
    with Heartbeat(queue, task, remaining, budget) as heartbeat:
        outcome, detail, duration_us = run_handler(rt, handler, ctx)
    if heartbeat.lost:
        return Outcome.LEASE_LOST
    return report(rt, task, outcome, detail, ctx=ctx, duration_us=duration_us)


def run_handler(rt: Runtime, handler: Handler, ctx: TaskContext) -> tuple[Outcome, object, int]:
    """Run the handler and classify how it ended: (outcome, detail, duration in µs)."""
    started = time.perf_counter()
    try:
        handler.run(ctx)
        outcome, detail = Outcome.SUCCESS, None
    except Yield as exc:
        outcome, detail = Outcome.YIELD, exc.seconds
    except PermanentFailure as exc:
        outcome, detail = Outcome.PERMANENT_FAILURE, str(exc) or type(exc).__name__
    except Exception as exc:
        log.warning("%s#%d failed: %r", ctx.taskClass, ctx.id, exc)
        wait = exc.wait if isinstance(exc, TemporaryFailure) else None
        if wait is None:
            wait = policy(handler.wait_before_retry, ctx)
        outcome, detail = (
            Outcome.FAILURE,
            wait if wait is not None else backoff(rt, ctx.failureCount),
        )
    elapsed = time.perf_counter() - started
    DURATION.labels(task_class=ctx.taskClass).observe(elapsed)
    return outcome, detail, int(elapsed * 1_000_000)


def report(
    rt: Runtime,
    task: Task,
    outcome: Outcome,
    detail: object,
    *,
    ctx: TaskContext | None = None,
    duration_us: int = 0,
) -> Outcome:
    """Write the outcome with its guarded statement; a lost fence writes nothing."""
    queue, owner = rt.queue, task.leaseOwner
    writes: dict[Outcome, Callable[[], bool]] = {
        Outcome.SUCCESS: lambda: queue.complete(
            task.id, owner, duration_us, ctx.followups if ctx else ()
        ),
        Outcome.PERMANENT_FAILURE: lambda: queue.fail_permanent(task.id, owner, str(detail)),
        Outcome.YIELD: lambda: queue.yield_(task.id, owner, int(detail)),
        Outcome.FAILURE: lambda: queue.fail_temporary(task.id, owner, int(detail)),
    }
    try:
        written = with_retries(rt, task.label, writes[outcome])
    except DatabaseUnavailable:
        log.error("%s: outcome %s not written; the lease will expire", task.label, outcome)
        return Outcome.UNREPORTED
    return outcome if written else Outcome.LEASE_LOST


@app.task(name="bridge.execute", acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def execute(task_id: int, owner: str, data: str | None = None, taskClass: str | None = None) -> str:
    """Run Phorge task ``task_id`` under lease ``owner`` (``data``: its JSON, when small)."""
    rt = runtime()
    outcome = run_task(rt, task_id, owner, data)
    OUTCOMES.labels(task_class=taskClass or "unknown", outcome=outcome.value).inc()
    label = f"{taskClass}#{task_id}" if taskClass else f"#{task_id}"
    log.info("%s: %s", label, outcome)
    return f"{label}: {outcome}"
