"""``bridge.execute`` and ``bridge.execute_batch``: the Celery tasks that hand leased
Phorge tasks to the engine (``bridge.engine.batch``) and report how they ended as
Celery states, registered on an app by :func:`install`.

A message's state is how it ended, not the Phorge task's: a yield is a SUCCESS whose
result says when the task is due again and how to find its next run, a new message,
in Flower (``dispatch.search_term``); a temporary failure is a RETRY (Phorge runs the
task again after its wait), any other end a FAILURE; a batch's result names each task's
outcome and the messages it sent the rest on in.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from numbers import Real
from typing import Any, NoReturn, cast

from celery import Celery, Task
from celery.exceptions import Retry
from celery.signals import task_postrun, task_prerun

from bridge.assembly import runtime
from bridge.engine.batch import Batch
from bridge.engine.redelivery import hand_back_redelivered
from bridge.engine.reports import RunReport
from bridge.engine.sides import PHD_SHARE
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
)
from bridge.queue import Outcome
from bridge.queue.model import Leased
from bridge.runtime.dispatch import (
    EXECUTE_BATCH,
    EXECUTE_TASK,
    Sent,
    search_term,
    send_messages,
)

log = logging.getLogger(__name__)

POLL_TASK = "bridge.poll"
GUARD_TASK = "bridge.canary_guard"  # bridge.runtime.canary_guard

NOT_DONE: dict[Outcome, type[TaskNotDone]] = {
    Outcome.FAILURE: TaskFailed,
    Outcome.PERMANENT_FAILURE: TaskFailedPermanently,
    Outcome.LEASE_LOST: LeaseLost,
    Outcome.NOT_SERVED: TaskNotServed,
    Outcome.UNREPORTED: OutcomeUnreported,
}
# A fallback is done too: the task goes on with the canary's old side.
BATCH_DONE = (Outcome.SUCCESS, Outcome.YIELD, Outcome.HANDED_BACK, Outcome.FALLBACK)
# Celery cuts a result's text at 1 KB in its log line and events; a batch's names each
# of its tasks and the messages it sent some on in.
BATCH_RESULT_MAX = 16384


def trace_of(request: Any, task_id: int, owner: str, task_class: str | None) -> TaskTrace:
    """The trace of a ``bridge.execute`` message: its sender's traceparent, or a new one."""
    return TaskTrace(
        task_id=task_id,
        task_class=task_class,
        owner=owner,
        traceparent=traceparent_or_new(request.get(TRACEPARENT_HEADER)),
    )


def execute_task(
    self: Task[Any, Any],
    task_id: int,
    owner: str,
    failure_count: int,
    data: str | None = None,
    task_class: str | None = None,
    repoll: bool = False,
    watch: int = 0,
) -> str:
    """Run Phorge task ``task_id`` under its dispatch lease (``data``: its JSON, when small).

    Returns ``'Class#id [native]: success'`` (the implementation that ran it in
    brackets), for a yield what :func:`yielded` says, for a canary's fallback
    its line (the old side takes the task: ``'Class#id [native]: fallback: reason; runner
    takes it'``); any other outcome raises (:func:`not_done`), so Celery's state is
    RETRY or FAILURE with the reason.
    ``repoll`` marks the middle of a full dispatch: once it has run, half the queue's
    capacity is free again, so the poller is asked to fill it now, not at the next beat.
    ``watch`` counts the copies sent to watch a run a live process holds (:func:`take_back`):
    such a copy, like a message the broker delivered again, never runs the task.
    """
    item = Leased(task_id, failure_count, task_class, data)
    if redelivered(self.request, watch):
        return take_back(self, owner, [item], watch)
    trace = current_trace() or trace_of(self.request, task_id, owner, task_class)
    batch = Batch(runtime(), owner, trace.traceparent)
    try:
        batch.run([item])
    finally:
        if repoll:
            ask_for_poll(self.app)
    _, report, line = batch.reports[0]
    if report.outcome in (Outcome.SUCCESS, Outcome.FALLBACK) or report.reason == PHD_SHARE:
        return line  # (phd's share runs in phd, not in a message)
    if report.outcome in (Outcome.YIELD, Outcome.HANDED_BACK):
        return yielded(line, item)
    not_done(line, [report], NOT_DONE[report.outcome](line))


def not_done(text: str, runs: Sequence[RunReport], failed: TaskNotDone) -> NoReturn:
    """End a message whose ``runs`` did not all succeed: in Celery's RETRY state when each
    was a temporary failure, which Phorge runs again after its wait (Flower counts it
    Retried, not Failed), else in FAILURE with ``failed``.

    The ``Retry`` carries ``failed`` and the wait; it is raised, never ``self.retry()``,
    which would send a new message: the database decides what runs again. Either is
    raised from what the first failed handler raised, so the state's traceback shows the
    handler's stack.
    """
    cause = next((run.error for run in runs if run.error is not None), None)
    if all(run.outcome is Outcome.FAILURE for run in runs):
        wait = min((run.wait for run in runs if run.wait is not None), default=None)
        # celery-types says ``numbers.Real``, which mypy does not see an int as.
        raise Retry(text, failed, when=cast(Real | None, wait)) from cause
    raise failed from cause


def yielded(line: str, item: Leased) -> str:
    """A yield's result: the message is done (SUCCESS, nothing left to revoke) and the
    row waits for its due time, when a poll sends it in a new message."""
    return f"{line}; runs again in a new message: search {search_term(item)}"


def redelivered(request: Any, watch: int) -> bool:
    """Whether the broker delivered this message before, or it is a copy that watches a
    live run (``bridge.engine.redelivery``): either never runs its tasks."""
    return watch > 0 or bool((request.delivery_info or {}).get("redelivered"))


def take_back(task: Task[Any, Any], owner: str, items: Sequence[Leased], watch: int) -> str:
    """A redelivered message's end: its leases whose run is not alive handed back, and a
    poll asked for, so they run again in a new lease at once. Those a live run holds are
    watched: a copy of the message comes back in :func:`watch_delay` seconds and looks
    again, so a run whose process dies later (its host lost: the database frees its locks
    a few seconds after the broker gave up on it) is still handed back in seconds."""
    rt = runtime()
    redelivery = hand_back_redelivered(rt, owner, items)
    line = redelivery.describe()
    if redelivery.handed_back or not watch:
        log.warning("%s", line)
    if redelivery.handed_back:
        ask_for_poll(task.app)
    running = set(redelivery.running)
    if running:
        watched = [item for item in items if item.id in running]
        args, kwargs = watch_copy(task.name, owner, watched, dict(task.request.kwargs or {}))
        task.apply_async(
            args,
            {**kwargs, "watch": watch + 1},
            countdown=watch_delay(watch),
            queue=rt.settings.router.queue_for(watched[0].task_class or ""),
        )
    return line


WATCH_FIRST = 2.0  # seconds before a run held elsewhere is looked at again
WATCH_MAX = 60.0  # and at most this long apart, for a partitioned run that goes on


def watch_delay(watch: int) -> float:
    """Seconds before watch number ``watch + 1``: doubling from :data:`WATCH_FIRST`."""
    return min(WATCH_FIRST * 2.0 ** min(watch, 8), WATCH_MAX)


def watch_copy(
    name: str, owner: str, items: Sequence[Leased], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a copy of ``name``'s message that watches ``items``."""
    kwargs.pop("repoll", None)
    if name == EXECUTE_TASK:
        [item] = items
        return (item.id, owner, item.failure_count), kwargs
    return (owner, [list(item) for item in items]), {}


def ask_for_poll(app: Celery) -> None:
    """Send a poll now, as beat sends one (quietly: ``quiet_polls``)."""
    app.tasks[POLL_TASK].apply_async()


def execute_batch(
    self: Task[Any, Any],
    owner: str,
    tasks: list[list[Any]],
    repoll: bool = False,
    watch: int = 0,
) -> str:
    """Run the tasks of a backlog's batch in order (each ``[id, failure_count, class,
    data]``, leased by ``owner``); see :func:`execute_task` for ``repoll``.

    Once the batch has run for a poll interval, the tasks left are sent on, as many a
    message as ran in that time, so long tasks spread over the workers. Returns
    :func:`batch_summary` when every task succeeded or yielded, else ends in RETRY (only
    temporary failures) or FAILURE (:func:`not_done`) with a :class:`BatchNotDone`,
    whose message adds the line of each task that did not.
    """
    rt = runtime()
    items = [Leased(*task) for task in tasks]
    if redelivered(self.request, watch):
        return take_back(self, owner, items, watch)
    traceparent = traceparent_or_new(self.request.get(TRACEPARENT_HEADER))
    batch = Batch(rt, owner, traceparent)
    started = time.monotonic()
    sent: list[Sent] = []
    handed_back: list[Leased] = []
    try:
        rest = batch.run(items, budget=rt.settings.poll_interval)
        if rest:
            pace = (time.monotonic() - started) / len(batch.reports)
            size = max(1, min(len(rest), int(rt.settings.poll_interval / pace)))
            queue = rt.settings.router.queue_for(rest[0].task_class or "")
            sent = send_messages(self.app, owner, rest, queue, size, sent_on=True)
            handed_back = rest[sum(len(message.tasks) for message in sent) :]
            if handed_back:
                rt.queue.free_own([item.id for item in handed_back], owner)
    finally:
        if repoll:
            ask_for_poll(self.app)
    summary = batch_summary(batch.reports, sent, handed_back)
    undone = [(run, line) for _, run, line in batch.reports if run.outcome not in BATCH_DONE]
    if undone:
        text = "; ".join([summary, *(line for _, line in undone)])
        not_done(text, [run for run, _ in undone], BatchNotDone(text))
    return summary


def batch_summary(
    reports: Sequence[tuple[Leased, RunReport, str]],
    sent: Sequence[Sent],
    handed_back: Sequence[Leased],
) -> str:
    """Each task's outcome, and the message each one sent on went in, e.g.
    ``'3 task(s): 1 failure (#7), 2 success (#5, #6); 2 sent on: bridge.execute[<id>]
    (#8), bridge.execute[<id>] (#9)'``; tasks the broker refused are ``handed back``."""
    by_outcome: dict[str, list[Leased]] = defaultdict(list)
    for item, report, _ in reports:
        by_outcome[report.outcome.value].append(item)
    outcomes = ", ".join(
        f"{len(done)} {name} ({ids(done)})" for name, done in sorted(by_outcome.items())
    )
    parts = [f"{len(reports)} task(s): {outcomes}"]
    if sent:
        messages = ", ".join(f"{message} ({ids(message.tasks)})" for message in sent)
        parts.append(f"{sum(len(message.tasks) for message in sent)} sent on: {messages}")
    if handed_back:
        parts.append(f"{len(handed_back)} handed back ({ids(handed_back)})")
    return "; ".join(parts)


def ids(tasks: Iterable[Leased]) -> str:
    return ", ".join(f"#{task.id}" for task in tasks)


_trace_tokens: dict[str, Any] = {}


def _begin_trace(
    task_id: str, task: Task[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any], **_: Any
) -> None:
    """Tag Celery's own lines about the run too (its "raised expected", "retry" or
    "succeeded")."""
    trace = trace_of(task.request, args[0], args[1], kwargs.get("task_class"))
    _trace_tokens[task_id] = begin_trace(trace)


def _end_trace(task_id: str, **_: Any) -> None:
    token = _trace_tokens.pop(task_id, None)
    if token is not None:
        end_trace(token)


def install(app: Celery) -> None:
    """Register both tasks on ``app``, and the signals that tag the lines of a run."""
    # Acked when the run ends, and given back to the broker when the pool's process dies
    # under it: a dead worker's messages are redelivered at once (``take_back``).
    one = app.task(
        name=EXECUTE_TASK,
        bind=True,
        ignore_result=True,
        throws=(TaskNotDone,),
        acks_late=True,
        reject_on_worker_lost=True,
    )(execute_task)
    app.task(
        name=EXECUTE_BATCH,
        bind=True,
        ignore_result=True,
        throws=(TaskNotDone,),
        resultrepr_maxsize=BATCH_RESULT_MAX,
        acks_late=True,
        reject_on_worker_lost=True,
    )(execute_batch)
    task_prerun.connect(_begin_trace, sender=one, weak=False)
    task_postrun.connect(_end_trace, sender=one, weak=False)
