"""Leased tasks of one owner, run in order, each outcome written fenced by its lease.

A task costs two round trips, the check (one read) and its outcome (one transaction);
in a batch, an outcome travels with the next task's check, so a batch costs one round
trip a task, and nothing runs before the outcome of the task before it is durable. A
handler that runs several tasks in one call (the Conduit proxy: one request) gets them
checked one after another before the call and their outcomes written in one round trip.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bridge.engine.context import Runtime
from bridge.engine.observers import observers
from bridge.engine.reports import ClearedTask, Ended, PendingOutcome, RunReport
from bridge.engine.run import prepare, retry_wait, run_cleared
from bridge.engine.sides import choose
from bridge.engine.tracing import TaskTrace, traced
from bridge.errors import DatabaseUnavailable, WritesRefused
from bridge.handlers.api import Handler
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


@dataclass(frozen=True)
class StagedOutcome:
    """A pending outcome with its guarded write (None: a success with follow-ups, which is
    written on its own with their ids), waiting for its round trip."""

    item: Leased
    pending: PendingOutcome
    write: Write | None
    wait: int | None

    @classmethod
    def of(cls, rt: Runtime, item: Leased, pending: PendingOutcome) -> StagedOutcome:
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
        return cls(item, pending, write, wait)

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
        self.chosen: dict[int, Handler] = {}  # the handler each checked task got

    def run(self, items: Sequence[Leased], budget: float | None = None) -> list[Leased]:
        """Run ``items``; once ``budget`` seconds have passed, or once the database refuses
        writes, the rest is returned unrun (still leased, for the caller to send on).

        Their run locks (``run_locks``) are held meanwhile, so a copy of the message the
        broker redelivers finds them running; a task whose lock a live run elsewhere
        holds is not run again here."""
        leases = [Lease(item.id, self.owner, item.failure_count) for item in items]
        try:
            held = self.rt.runs.hold(leases)
        except DatabaseUnavailable as exc:
            self.unreported(items, f"database unavailable ({exc}); the lease will expire")
            return []
        mine = [item for item, ok in zip(items, held, strict=True) if ok]
        for item in (item for item, ok in zip(items, held, strict=True) if not ok):
            with traced(self.trace(item)):
                self.report(item, RunReport(Outcome.LEASE_LOST, RUNNING_ELSEWHERE))
        try:
            return self.run_held(mine, budget)
        finally:
            self.rt.runs.release([lease for lease, ok in zip(leases, held, strict=True) if ok])

    def run_held(self, items: Sequence[Leased], budget: float | None) -> list[Leased]:
        started = time.monotonic()
        gate = self.rt.writes
        index = 0
        while index < len(items):
            if index and budget is not None and time.monotonic() - started >= budget:
                self.flush()
                return list(items[index:])
            if not gate.is_open:
                # No task starts while writes are refused: a batch gives back what it has
                # not started, and a message's first task waits for writes (its lease
                # cannot outlast the dispatch lease, so neither does the wait).
                self.flush()
                if index:
                    return list(items[index:])
                gate.wait_open(self.rt.settings.dispatch_lease)
            group = self.group(items, index)
            try:
                self.run_group(group)
            except WritesRefused as exc:
                gate.refused(exc)
                if index:
                    self.flush()  # outcomes that waited for this task's are held
                    return list(items[index:])
                self.unreported(items, f"not started: {exc}; the lease will expire")
                return []
            except DatabaseUnavailable as exc:
                staged, self.staged = self.staged, []
                self.report_writes(staged, [exc] * len(staged))
                self.unreported(
                    items[index:], f"database unavailable ({exc}); the lease will expire"
                )
                return []
            index += len(group)
        self.flush()
        return []

    def handler_of(self, item: Leased) -> Handler | None:
        """The handler ``item`` got when it was checked; before, the one it should get
        (under a canary, as if its row never failed: the check may send it to PHP)."""
        chosen = self.chosen.get(item.id)
        if chosen is not None or not item.task_class:
            return chosen
        return choose(self.rt.registry, self.canary, item.task_class, item.id, None).handler

    def group(self, items: Sequence[Leased], index: int) -> Sequence[Leased]:
        """The tasks from ``index`` on that run in one handler call: the consecutive ones
        a handler with a call for several serves, up to its ``batch_limit``; else one."""
        handler = self.handler_of(items[index])
        end = index + 1
        if handler is not None and runs_together(handler):
            limit = min(len(items), index + batch_limit(handler))
            while end < limit and self.handler_of(items[end]) is handler:
                end += 1
        return items[index:end]

    def unreported(self, items: Sequence[Leased], reason: str) -> None:
        for item in items:
            with traced(self.trace(item)):
                self.report(item, RunReport(Outcome.UNREPORTED, reason))

    def trace(self, item: Leased) -> TaskTrace:
        return TaskTrace(item.id, item.task_class, self.owner, self.traceparent or "")

    def run_group(self, group: Sequence[Leased]) -> None:
        """Check, run and stage the outcomes of one handler call's tasks."""
        leases = [Lease(item.id, self.owner, item.failure_count) for item in group]
        checked = [self.check(group[0], leases[0])]
        session = self.rt.queue.session
        checked += [
            session.check(lease, item.data)
            for item, lease in zip(group[1:], leases[1:], strict=True)
        ]
        cleared: list[tuple[Leased, ClearedTask]] = []
        for item, lease, task in zip(group, leases, checked, strict=True):
            with traced(self.trace(item)):
                prepared = prepare(self.rt, lease, task, self.traceparent, self.canary)
                if isinstance(prepared, ClearedTask):
                    self.chosen[item.id] = prepared.handler
                    cleared.append((item, prepared))
                else:
                    self.stage(item, prepared)
        for calls in handler_calls(cleared):
            with traced(self.trace(calls[0][0])):
                runs = run_cleared(self.rt, [task for _, task in calls])
            for (item, _), ended in zip(calls, runs, strict=True):
                with traced(self.trace(item)):
                    self.stage(item, ended)

    def stage(self, item: Leased, ended: Ended) -> None:
        """Report a run that has nothing to write; stage an outcome to write (a success
        with follow-ups is written at once, alone, with their ids)."""
        if isinstance(ended, RunReport):
            self.report(item, ended)
            return
        try:
            staged = StagedOutcome.of(self.rt, item, ended)
        except ValueError as exc:  # a duration or wait out of Phorge's range
            self.report(item, StagedOutcome(item, ended, None, None).report(exc))
            return
        if staged.write is not None:
            self.staged.append(staged)
        else:
            self.report_writes([staged], self.write([staged]))

    def defers(self, item: Leased) -> bool:
        """Whether the staged outcomes wait for ``item``'s: they and it are of one
        transport handler that runs its tasks one by one and whose outcomes share a commit
        (the PHP runner), fewer than its ``batch_limit`` so far. Each such task is still
        checked just before it runs, its lease counted from there."""
        handler = self.handler_of(item)
        return (
            handler is not None
            and not runs_together(handler)
            and len(self.staged) < batch_limit(handler)
            and all(self.handler_of(s.item) is handler for s in self.staged)
        )

    def check(self, item: Leased, lease: Lease) -> Task | None:
        """The check of ``lease``, sharing its round trip with the staged outcomes
        (unless they wait for this task's, :meth:`defers`)."""
        session = self.rt.queue.session
        if not self.staged or self.defers(item):
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


def handler_calls(
    cleared: Sequence[tuple[Leased, ClearedTask]],
) -> list[list[tuple[Leased, ClearedTask]]]:
    """Cleared tasks cut into handler calls: consecutive ones of one handler that runs
    several in one call (``runs_together``) share one, every other task has its own. A
    group is made before its check, which may send a task elsewhere (a canary's row
    that fell back goes to PHP), so the handler each one actually got decides."""
    calls: list[list[tuple[Leased, ClearedTask]]] = []
    for entry in cleared:
        handler = entry[1].handler
        if calls and calls[-1][0][1].handler is handler and runs_together(handler):
            calls[-1].append(entry)
        else:
            calls.append([entry])
    return calls


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
