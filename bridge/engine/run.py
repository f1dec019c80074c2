"""One leased task's run, in the order of ``PhabricatorWorkerActiveTask::executeTask``.

Check the lease, apply the maximum retry count, make sure the lease covers the run,
run, and say how it ended: final (:class:`Ran`, nothing left to write) or with an
outcome to write under the lease (:class:`Done`). Writing it is the batch's part
(``bridge.engine.batch``); sending and receiving messages is Celery's
(``bridge.runtime``), so this module knows nothing of either.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from bridge.engine.context import Runtime
from bridge.engine.metrics import RENEWALS, run_timers
from bridge.handlers.api import Handler, TaskContext
from bridge.handlers.outcome import HandlerResult, clear, run_handler, run_handlers
from bridge.queue import Lease, Outcome, Task
from bridge.queue.model import Leased


@dataclass(frozen=True)
class Ran:
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
class Done:
    """A run whose outcome is ready to be written under its lease, which runs out at
    ``expires`` (monotonic time): a refused write is tried again until then."""

    lease: Lease
    result: HandlerResult
    expires: float
    ctx: TaskContext | None = None


class RunObserver:
    """Hears every run's start and end, for measuring (the benchmark kit) without
    patching the engine; subclass and override what you need, then :func:`observe`."""

    def run_started(self, lease: Lease) -> None:
        """The run's check is done and the handler is about to be looked up."""

    def run_ended(self, item: Leased, ran: Ran) -> None:
        """The run's outcome was written (or why none was is known)."""


_observers: list[RunObserver] = []


def observe(observer: RunObserver) -> Callable[[], None]:
    """Add ``observer`` to every run of this process; returns what removes it."""
    _observers.append(observer)
    return lambda: _observers.remove(observer)


def observers() -> list[RunObserver]:
    return _observers


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
class Ready:
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
) -> Ran | Done | Ready:
    """Everything before a task's run that its check found (``task``, None when the lease
    no longer held): ended already (``Ran``, ``Done``) or cleared to run (``Ready``)."""
    for observer in _observers:
        observer.run_started(lease)
    if task is None:
        return Ran(Outcome.LEASE_LOST, "the lease was no longer held before the run")
    handler = rt.registry.handler_for(task.task_class)
    if handler is None:
        # Configuration changed since the poll: give the row back to whoever can run it.
        rt.queue.free_own([task.id], lease.owner)
        return Ran(Outcome.NOT_SERVED, "no handler serves this class here; lease handed back")
    remaining = (task.lease_expires or 0) - (task.server_time or 0)
    breaker = handler.breaker
    if breaker is not None and not breaker.allow():
        # Its transport is down in this worker (PHP cannot boot, Conduit is unreachable):
        # the row goes back at once, for a worker that can run it, not into a yield that
        # would hold it for 5 s and starve the fleet's pace (issue 31).
        back = HandlerResult(Outcome.HANDED_BACK, reason=f"held back: {breaker.reason}")
        return Done(lease, back, time.monotonic() + remaining)
    if task.data_error:
        failed = HandlerResult(Outcome.PERMANENT_FAILURE, reason=task.data_error)
        return Done(lease, failed, time.monotonic() + remaining)
    ctx = context(task, lease, traceparent)
    cleared = clear(handler, ctx)
    if isinstance(cleared, HandlerResult):
        return Done(lease, cleared, time.monotonic() + remaining)
    required = cleared.required_lease
    if required is not None:  # as PHP's setLeaseDuration(): set, shorter or longer
        claimed = rt.queue.session.renew(lease, required)
        RENEWALS.labels(result="renewed" if claimed else "lost").inc()
        if not claimed:
            return Ran(Outcome.LEASE_LOST, "the lease was lost while claiming the required lease")
        remaining = required
    return Ready(lease, task.label, handler, ctx, remaining, required or rt.settings.default_lease)


def execute(rt: Runtime, group: Sequence[Ready]) -> list[Ran | Done]:
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
        else:
            results = run_handlers(handler, [r.ctx for r in group])
    share = (time.perf_counter() - started) / len(group)
    ended: list[Ran | Done] = []
    for ready, result, watch in zip(group, results, watches, strict=True):
        wall_time, duration = run_timers(ready.ctx.task_class)
        wall_time.observe(share)
        duration.observe(result.duration_us / 1e6)
        if watch.lost:
            ended.append(Ran(Outcome.LEASE_LOST, "the lease expired while the handler ran"))
        else:
            ended.append(Done(ready.lease, result, watch.expires, ready.ctx))
    return ended
