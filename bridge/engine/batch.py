"""Leased tasks of one owner, run in order, each outcome written fenced by its lease.

A message's tasks go through one pipeline, a group at a time (:meth:`Batch.run`): their
run locks held, cut into handler calls, checked, run (``bridge.engine.run``: one
group's run), their outcomes staged, written and reported.

A task costs two round trips, the check (one read) and its outcome (one transaction);
in a batch, an outcome travels with the next task's check, so a batch costs one round
trip a task, and nothing runs before the outcome of the task before it is durable. A
handler that runs several tasks in one call (the Conduit proxy: one request) gets them
checked one after another before the call and their outcomes written in one round trip.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bridge.engine.context import Runtime
from bridge.engine.observers import observers
from bridge.engine.reports import CheckedTask, Ended, PendingOutcome, RunReport
from bridge.engine.run import run_group
from bridge.engine.sides import choose
from bridge.engine.tracing import TaskTrace, traced
from bridge.errors import DatabaseUnavailable, WritesRefused
from bridge.handlers.api import Handler, TaskContext
from bridge.handlers.capabilities import batch_limit, runs_together
from bridge.queue import Lease, Outcome, Task
from bridge.queue.model import Leased
from bridge.queue.session import (
    Write,
    fell_back,
    handed_back,
    permanent_failure,
    success,
    temporary_failure,
    yielded,
)

log = logging.getLogger(__name__)

RUNNING_ELSEWHERE = "a live run elsewhere holds this lease; not run again here"


def backoff(rt: Runtime, failure_count: int) -> int:
    """Exponential wait with jitter for native handlers of classes Phorge does not have."""
    settings = rt.settings
    wait = min(settings.retry_max, settings.retry_base * 2 ** min(failure_count, 30))
    return int(wait * (1 + random.uniform(0, settings.retry_jitter)))


def retry_wait(rt: Runtime, ctx: TaskContext, declared: int | None) -> int:
    """The wait after a temporary failure: the one declared, else the backoff."""
    return declared if declared is not None else backoff(rt, ctx.failure_count)


@dataclass(frozen=True)
class StagedOutcome:
    """A pending outcome with its guarded write (None: a success with follow-ups, which is
    written on its own with their ids), waiting for its round trip; ``handler``: the one
    whose outcomes it may share a commit with (:meth:`Batch.defers`)."""

    item: Leased
    pending: PendingOutcome
    write: Write | None
    wait: int | None
    handler: Handler | None = None

    @classmethod
    def of(
        cls, rt: Runtime, item: Leased, pending: PendingOutcome, handler: Handler | None
    ) -> StagedOutcome:
        lease, result = pending.lease, pending.result
        wait = None
        match result.outcome:
            case Outcome.SUCCESS:
                write = (
                    None
                    if result.followups
                    else success(lease, result.duration_us, pending.archived_as)
                )
            case Outcome.PERMANENT_FAILURE:
                write = permanent_failure(lease, pending.archived_as)
            case Outcome.YIELD:
                wait = result.delay or 0
                write = yielded(lease, wait)
            case Outcome.HANDED_BACK:
                write = handed_back(lease)
            case Outcome.FALLBACK:
                write = fell_back(lease)
            case _:
                assert pending.ctx is not None
                wait = retry_wait(rt, pending.ctx, result.delay)
                write = temporary_failure(lease, wait, pending.archived_as)
        return cls(item, pending, write, wait, handler)

    def write_alone(self, rt: Runtime) -> bool:
        session, lease, result = rt.queue.session, self.pending.lease, self.pending.result
        if self.write is None:
            archived_as = self.pending.archived_as
            return session.complete(lease, result.duration_us, result.followups, archived_as)
        return session.apply([self.write])[0]

    def report(self, written: bool | Exception) -> RunReport:
        """How the run ended, once its outcome's write was tried."""
        result, task_id = self.pending.result, self.pending.lease.task_id
        implementation = self.pending.implementation
        if isinstance(written, Exception):
            for observer in observers():
                observer.outcome_unwritten(self.item, result)
            log.error(
                "task %d: outcome %s not written; the lease will expire (%s)",
                task_id,
                result.outcome,
                written,
                exc_info=None if isinstance(written, DatabaseUnavailable) else written,
            )
            unwritten = f"{result.outcome} not written: {written}"
            return RunReport(Outcome.UNREPORTED, unwritten, implementation=implementation)
        if not written:
            lost = f"{result.outcome} not written: the lease was lost"
            return RunReport(Outcome.LEASE_LOST, lost, implementation=implementation)
        if result.outcome is Outcome.PERMANENT_FAILURE:
            log.warning("task %d failed permanently: %s", task_id, result.reason)
        return RunReport(result.outcome, result.reason, self.wait, result.error, implementation)


class Batch:
    """Runs leased tasks of one owner in order, each checked just before it runs.

    A task's outcome is staged, then written, in its own committed transaction, in the
    round trip that checks the next task: a batch costs one round trip a task, plus one
    for the last outcome, and nothing runs before the outcome of the task before it is
    durable. A transport handler that takes several tasks in one call (a
    :class:`~bridge.handlers.capabilities.BatchHandler`) gets a run of consecutive tasks
    it serves, checked together before the call; their outcomes are written together
    after it.
    """

    def __init__(self, rt: Runtime, owner: str, traceparent: str | None) -> None:
        self.rt, self.owner, self.traceparent = rt, owner, traceparent
        self.staged: list[StagedOutcome] = []  # outcomes waiting for their round trip
        self.reports: list[tuple[Leased, RunReport, str]] = []  # and each one's line
        self.canary = rt.canary.current()  # the weights in force, read once a message

    def run(self, items: Sequence[Leased], budget: float | None = None) -> list[Leased]:
        """Run ``items``, a handler call's group at a time: held, cut, checked, run and
        staged, each step handing its result to the next; once ``budget`` seconds have
        passed, or once the database refuses writes, the rest is returned unrun (still
        leased, for the caller to send on)."""
        held = self.hold(items)
        started, done = time.monotonic(), 0
        try:
            while done < len(held) and not self.stops(done, time.monotonic() - started, budget):
                handler, group = self.group(held, done)
                try:
                    tasks = self.check(group, handler)
                    for task, ended in run_group(self.rt, tasks, self.traceparent, self.canary):
                        self.stage(task, ended, handler)
                except (WritesRefused, DatabaseUnavailable) as exc:
                    return self.abandon(held, done, exc)
                done += len(group)
            self.flush()
            return list(held[done:])
        finally:
            self.rt.runs.release([self.lease(item) for item in held])

    def hold(self, items: Sequence[Leased]) -> Sequence[Leased]:
        """The tasks whose run locks (``run_locks``) this process now holds, for the
        batch's length, so that a copy of the message the broker redelivers finds them
        running; a task whose lock a live run elsewhere holds is not run again here, and
        none runs while the database is unavailable (their leases will expire)."""
        leases = [self.lease(item) for item in items]
        try:
            held = self.rt.runs.hold(leases)
        except DatabaseUnavailable as exc:
            self.unreported(items, f"database unavailable ({exc}); the lease will expire")
            return []
        for item in (item for item, ok in zip(items, held, strict=True) if not ok):
            with traced(self.trace(item)):
                self.report(item, RunReport(Outcome.LEASE_LOST, RUNNING_ELSEWHERE))
        return [item for item, ok in zip(items, held, strict=True) if ok]

    def stops(self, done: int, elapsed: float, budget: float | None) -> bool:
        """Whether the tasks from ``done`` on go back unrun: the ``budget`` is spent, or
        the database refuses writes. No task starts while writes are refused: a message's
        first task waits for writes instead (its lease cannot outlast the dispatch lease,
        so neither does the wait)."""
        if done and budget is not None and elapsed >= budget:
            return True
        gate = self.rt.writes
        if not gate.is_open:
            if done:
                return True
            gate.wait_open(self.rt.settings.dispatch_lease)
        return False

    def group(self, items: Sequence[Leased], start: int) -> tuple[Handler | None, Sequence[Leased]]:
        """The tasks from ``start`` on that run in one handler call, and the handler they
        should get: the consecutive ones a handler with a call for several serves, up to
        its ``batch_limit``; else one."""
        handler = self.expected(items[start])
        end = start + 1
        if handler is not None and runs_together(handler):
            limit = min(len(items), start + batch_limit(handler))
            while end < limit and self.expected(items[end]) is handler:
                end += 1
        return handler, items[start:end]

    def expected(self, item: Leased) -> Handler | None:
        """The handler ``item`` should get, before its check (under a canary, as if its row
        never failed: the check may send it to PHP, ``run.handler_calls``)."""
        if not item.task_class:
            return None
        return choose(self.rt.registry, self.canary, item.task_class, item.id, None).handler

    def check(self, group: Sequence[Leased], handler: Handler | None) -> list[CheckedTask]:
        """The checks of one handler call's tasks: the first one's in the round trip of
        the staged outcomes (:meth:`check_first`), the others' one after another."""
        leases = [self.lease(item) for item in group]
        tasks = [self.check_first(group[0], leases[0], handler)]
        session = self.rt.queue.session
        tasks += [
            session.check(lease, item.data)
            for item, lease in zip(group[1:], leases[1:], strict=True)
        ]
        return [
            CheckedTask(item, lease, task, self.trace(item))
            for item, lease, task in zip(group, leases, tasks, strict=True)
        ]

    def stage(self, checked: CheckedTask, ended: Ended, handler: Handler | None) -> None:
        """Report a run that has nothing to write; stage an outcome to write (a success
        with follow-ups is written at once, alone, with their ids). ``handler``: the one
        its group was cut for, which stands for the one that ran it when none did."""
        item = checked.item
        with traced(checked.trace):
            if isinstance(ended, RunReport):
                self.report(item, ended)
                return
            ran = handler if ended.handler is None else ended.handler
            try:
                staged = StagedOutcome.of(self.rt, item, ended, ran)
            except ValueError as exc:  # a duration or wait out of Phorge's range
                self.report(item, StagedOutcome(item, ended, None, None).report(exc))
                return
            if staged.write is not None:
                self.staged.append(staged)
            else:
                self.report_writes([staged], self.write([staged]))

    def abandon(
        self, items: Sequence[Leased], index: int, exc: DatabaseUnavailable
    ) -> list[Leased]:
        """What is left of ``items`` once ``exc`` stopped the group at ``index``. Writes
        refused: the tasks from there on go back unrun, after the outcomes that waited for
        the group's (for a message's first group, their leases will expire). The database
        unavailable: nothing more is written, and the leases will expire."""
        if isinstance(exc, WritesRefused):
            self.rt.writes.refused(exc)
            if index:
                self.flush()  # outcomes that waited for this task's are held
                return list(items[index:])
            self.unreported(items, f"not started: {exc}; the lease will expire")
            return []
        staged, self.staged = self.staged, []
        self.report_writes(staged, [exc] * len(staged))
        self.unreported(items[index:], f"database unavailable ({exc}); the lease will expire")
        return []

    def lease(self, item: Leased) -> Lease:
        return Lease(item.id, self.owner, item.failure_count)

    def trace(self, item: Leased) -> TaskTrace:
        return TaskTrace(item.id, item.task_class, self.owner, self.traceparent or "")

    def unreported(self, items: Sequence[Leased], reason: str) -> None:
        for item in items:
            with traced(self.trace(item)):
                self.report(item, RunReport(Outcome.UNREPORTED, reason))

    def defers(self, handler: Handler | None) -> bool:
        """Whether the staged outcomes wait for those of the next group (``handler``'s):
        they and it are of one transport handler that runs its tasks one by one and whose
        outcomes share a commit (the PHP runner), fewer than its ``batch_limit`` so far.
        Each such task is still checked just before it runs, its lease counted from there."""
        return (
            handler is not None
            and not runs_together(handler)
            and len(self.staged) < batch_limit(handler)
            and all(s.handler is handler for s in self.staged)
        )

    def check_first(self, item: Leased, lease: Lease, handler: Handler | None) -> Task | None:
        """The check of ``lease``, sharing its round trip with the staged outcomes
        (unless they wait for this task's, :meth:`defers`)."""
        session = self.rt.queue.session
        if not self.staged or self.defers(handler):
            return session.check(lease, item.data)
        staged, self.staged = self.staged, []
        try:
            written, task = session.write_then_check(
                [s.write for s in staged if s.write is not None], lease, item.data
            )
        except WritesRefused as exc:
            self.report_writes(staged, self.write(staged, refused=exc))
            if not self.rt.writes.is_open:
                raise  # the next task must not start
            return session.check(lease, item.data)
        except DatabaseUnavailable as exc:
            self.report_writes(staged, [exc] * len(staged))
            raise
        except Exception:
            # The server refused the staged outcomes: they are tried, and fail, alone.
            self.staged = staged
            self.flush()
            return session.check(lease, item.data)
        self.report_writes(staged, list(written))
        return task

    def write(
        self, staged: Sequence[StagedOutcome], refused: WritesRefused | None = None
    ) -> list[bool | Exception]:
        """Write ``staged`` together, in one round trip; each one's result, or what kept
        it from the database. While the database refuses writes (``refused``: it just
        did), they are tried again, together, for as long as their leases last: a
        refusal shorter than a lease loses no outcome and runs nothing twice."""
        gate = self.rt.writes
        expires = min(s.pending.expires for s in staged)
        while True:
            if refused is not None:
                gate.refused(refused)
                gate.pause()
                if time.monotonic() >= expires:
                    return [refused] * len(staged)
            try:
                if len(staged) == 1:
                    return [staged[0].write_alone(self.rt)]
                writes = [s.write for s in staged if s.write is not None]
                return list(self.rt.queue.session.apply(writes))
            except WritesRefused as again:
                refused = again
            except Exception as exc:
                return [exc] * len(staged)

    def report_writes(
        self, staged: Sequence[StagedOutcome], written: Sequence[bool | Exception]
    ) -> None:
        if not self.rt.writes.is_open and any(not isinstance(w, Exception) for w in written):
            self.rt.writes.accepted()
        for outcome, result in zip(staged, written, strict=True):
            with traced(self.trace(outcome.item)):
                self.report(outcome.item, outcome.report(result))

    def report(self, item: Leased, report: RunReport) -> None:
        """Log how a task's run ended (under its trace) and tell the observers; a fallback
        at WARNING (the new side failed it, and the line says who takes it)."""
        line = report.describe(item.label)
        log.log(logging.WARNING if report.outcome is Outcome.FALLBACK else logging.INFO, "%s", line)
        self.reports.append((item, report, line))
        for observer in observers():
            observer.run_ended(item, report)

    def flush(self) -> None:
        """Write the staged outcomes, together, in one round trip."""
        if self.staged:
            staged, self.staged = self.staged, []
            self.report_writes(staged, self.write(staged))


def run_task(
    rt: Runtime,
    lease: Lease,
    data_json: str | None = None,
    traceparent: str | None = None,
    task_class: str | None = None,
) -> RunReport:
    """Execute one leased task end to end; returns what happened."""
    if lease.failure_count is None:
        raise ValueError("a run is fenced on its lease's failure count; this lease has none")
    batch = Batch(rt, lease.owner, traceparent)
    batch.run([Leased(lease.task_id, lease.failure_count, task_class, data_json)])
    return batch.reports[0][1]
