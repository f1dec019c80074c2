"""``bridge.execute`` and ``bridge.execute_batch``: the Celery tasks that hand leased
Phorge tasks to the engine (``bridge.engine.batch``) and report how they ended as
Celery states, registered on an app by :func:`install`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any, cast

from celery import Celery, Task
from celery.exceptions import Retry
from celery.signals import task_postrun, task_prerun

from bridge.engine.batch import Batch
from bridge.engine.context import runtime
from bridge.engine.tracing import (
    TRACEPARENT_HEADER,
    TaskTrace,
    begin_trace,
    current_trace,
    end_trace,
    traceparent_or_new,
)
from bridge.errors import (
    BatchNotDone,
    LeaseLost,
    OutcomeUnreported,
    TaskFailed,
    TaskFailedPermanently,
    TaskNotDone,
    TaskNotServed,
    TaskYielded,
)
from bridge.queue import Outcome
from bridge.queue.model import Leased
from bridge.runtime.dispatch import EXECUTE_BATCH, EXECUTE_TASK, send

if TYPE_CHECKING:
    from numbers import Real

POLL_TASK = "bridge.poll"

NOT_DONE: dict[Outcome, type[TaskNotDone]] = {
    Outcome.FAILURE: TaskFailed,
    Outcome.PERMANENT_FAILURE: TaskFailedPermanently,
    Outcome.LEASE_LOST: LeaseLost,
    Outcome.NOT_SERVED: TaskNotServed,
    Outcome.UNREPORTED: OutcomeUnreported,
}
BATCH_DONE = (Outcome.SUCCESS, Outcome.YIELD)


def trace_of(request: Any, task_id: int, owner: str, task_class: str | None) -> TaskTrace:
    """The trace of a ``bridge.execute`` message: its sender's traceparent, or a new one."""
    return TaskTrace(
        task_id=task_id,
        task_class=task_class,
        owner=owner,
        traceparent=traceparent_or_new(request.get(TRACEPARENT_HEADER)),
    )


def execute(
    self: Task[Any, Any],
    task_id: int,
    owner: str,
    failure_count: int,
    data: str | None = None,
    task_class: str | None = None,
    repoll: bool = False,
) -> str:
    """Run Phorge task ``task_id`` under its dispatch lease (``data``: its JSON, when small).

    Returns ``'Class#id: success'``; any other outcome raises a :class:`TaskNotDone`
    (a yield inside a ``Retry``), so Celery's state is the outcome's. ``repoll`` marks the
    middle of a full dispatch: once it has run, half the queue's capacity is free again,
    so the poller is asked to fill it now, not at the next beat.
    """
    item = Leased(task_id, failure_count, task_class, data)
    trace = current_trace() or trace_of(self.request, task_id, owner, task_class)
    batch = Batch(runtime(), owner, trace.traceparent)
    try:
        batch.run([item])
    finally:
        if repoll:
            self.app.send_task(POLL_TASK)
    _, ran, line = batch.ran[0]
    if ran.outcome is Outcome.SUCCESS:
        return line
    if ran.outcome is Outcome.YIELD:
        # celery-types annotates ``when`` as ``numbers.Real``, which mypy never matches
        # with an int; Celery takes seconds as any number.
        raise Retry(line, exc=TaskYielded(line), when=cast("Real | None", ran.wait))
    raise NOT_DONE[ran.outcome](line)


def execute_batch(
    self: Task[Any, Any], owner: str, tasks: list[list[Any]], repoll: bool = False
) -> str:
    """Run the tasks of a backlog's batch in order (each ``[id, failure_count, class,
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
            sent = send(self.app, owner, rest, queue, size, sent_on=True)
            if sent < len(rest):
                rt.queue.free_own([item.id for item in rest[sent:]], owner)
    finally:
        if repoll:
            self.app.send_task(POLL_TASK)
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


def _begin_trace(
    task_id: str, task: Task[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any], **_: Any
) -> None:
    """Tag Celery's own lines about the run too (its "raised expected" or "succeeded")."""
    trace = trace_of(task.request, args[0], args[1], kwargs.get("task_class"))
    _trace_tokens[task_id] = begin_trace(trace)


def _end_trace(task_id: str, **_: Any) -> None:
    token = _trace_tokens.pop(task_id, None)
    if token is not None:
        end_trace(token)


def install(app: Celery) -> None:
    """Register both tasks on ``app``, and the signals that tag the lines of a run."""
    one = app.task(name=EXECUTE_TASK, bind=True, ignore_result=True, throws=(TaskNotDone,))(execute)
    app.task(name=EXECUTE_BATCH, bind=True, ignore_result=True, throws=(TaskNotDone,))(
        execute_batch
    )
    task_prerun.connect(_begin_trace, sender=one, weak=False)
    task_postrun.connect(_end_trace, sender=one, weak=False)
