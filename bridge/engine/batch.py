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
from bridge.engine.metrics import UNWRITTEN, outcome_counter
from bridge.engine.run import Done, Ran, Ready, execute, observers, prepare, retry_wait
from bridge.engine.tracing import TaskTrace, traced
from bridge.errors import DatabaseUnavailable, WritesRefused
from bridge.handlers.api import Handler
from bridge.queue import Lease, Outcome, Task
from bridge.queue.model import Leased
from bridge.queue.session import (
    Write,
    handed_back,
    permanent_failure,
    success,
    temporary_failure,
    yielded,
)

log = logging.getLogger(__name__)


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
            case Outcome.HANDED_BACK:
                write = handed_back(lease)
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
            UNWRITTEN.labels(self.item.task_class or "unknown", result.outcome.value).inc()
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
        return Ran(result.outcome, result.reason, self.wait, result.error)


class Batch:
    """Runs leased tasks of one owner in order, each checked just before it runs.

    A task's outcome is written, in its own committed transaction, in the round trip
    that checks the next task: a batch costs one round trip a task, plus one for the
    last outcome, and nothing runs before the outcome of the task before it is durable.
    A handler that takes several tasks at once (``Handler.batch_limit``) gets a run of
    consecutive tasks it serves, checked together before the call; their outcomes are
    written together after it.
    """

    def __init__(self, rt: Runtime, owner: str, traceparent: str | None) -> None:
        self.rt, self.owner, self.traceparent = rt, owner, traceparent
        self.pending: list[Finished] = []  # outcomes to write, each with its write
        self.ran: list[tuple[Leased, Ran, str]] = []  # and each one's line

    def run(self, items: Sequence[Leased], budget: float | None = None) -> list[Leased]:
        """Run ``items``; once ``budget`` seconds have passed, or once the database refuses
        writes, the rest is returned unrun (still leased, for the caller to send on)."""
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
                self.step(group)
            except WritesRefused as exc:
                gate.refused(exc)
                if index:
                    self.flush()  # outcomes that waited for this task's are held
                    return list(items[index:])
                self.unreported(items, f"not started: {exc}; the lease will expire")
                return []
            except DatabaseUnavailable as exc:
                pending, self.pending = self.pending, []
                self.settle(pending, [exc] * len(pending))
                self.unreported(
                    items[index:], f"database unavailable ({exc}); the lease will expire"
                )
                return []
            index += len(group)
        self.flush()
        return []

    def handler_of(self, item: Leased) -> Handler | None:
        return self.rt.registry.handler_for(item.task_class) if item.task_class else None

    def group(self, items: Sequence[Leased], index: int) -> Sequence[Leased]:
        """The tasks from ``index`` on that run in one handler call: the consecutive ones
        a handler with a call for several serves, up to its ``batch_limit``; else one."""
        registry = self.rt.registry
        handler = self.handler_of(items[index])
        end = index + 1
        if handler is not None and runs_together(handler):
            limit = min(len(items), index + handler.batch_limit)
            while (
                end < limit
                and (cls := items[end].task_class)
                and (registry.handler_for(cls) is handler)
            ):
                end += 1
        return items[index:end]

    def unreported(self, items: Sequence[Leased], reason: str) -> None:
        for item in items:
            with traced(self.trace(item)):
                self.record(item, Ran(Outcome.UNREPORTED, reason))

    def trace(self, item: Leased) -> TaskTrace:
        return TaskTrace(item.id, item.task_class, self.owner, self.traceparent or "")

    def step(self, group: Sequence[Leased]) -> None:
        """Check, run and stage the outcomes of one handler call's tasks."""
        leases = [Lease(item.id, self.owner, item.failure_count) for item in group]
        checked = [self.check(group[0], leases[0])]
        session = self.rt.queue.session
        checked += [
            session.held(lease, item.data)
            for item, lease in zip(group[1:], leases[1:], strict=True)
        ]
        cleared: list[tuple[Leased, Ready]] = []
        for item, lease, task in zip(group, leases, checked, strict=True):
            with traced(self.trace(item)):
                ready = prepare(self.rt, lease, task, self.traceparent)
                if isinstance(ready, Ready):
                    cleared.append((item, ready))
                else:
                    self.ended(item, ready)
        if not cleared:
            return
        with traced(self.trace(cleared[0][0])):
            runs = execute(self.rt, [ready for _, ready in cleared])
        for (item, _), ended in zip(cleared, runs, strict=True):
            with traced(self.trace(item)):
                self.ended(item, ended)

    def ended(self, item: Leased, ended: Ran | Done) -> None:
        """Record a final run; stage an outcome to write (a success with follow-ups is
        written at once, alone, with their ids)."""
        if isinstance(ended, Ran):
            self.record(item, ended)
            return
        try:
            finished = Finished.of(self.rt, item, ended)
        except ValueError as exc:  # a duration or wait out of Phorge's range
            self.record(item, Finished(item, ended, None, None).verdict(exc))
            return
        if finished.write is not None:
            self.pending.append(finished)
            return
        try:
            written: bool | Exception = finished.write_alone(self.rt)
        except WritesRefused as exc:
            written = self.hold([finished], exc)[0]
        except Exception as exc:
            written = exc
        self.settle([finished], [written])

    def defers(self, item: Leased) -> bool:
        """Whether the pending outcomes wait for ``item``'s: they and it are of one
        handler that runs its tasks one by one and whose outcomes share a commit (the PHP
        runner), fewer than its ``batch_limit`` so far. Each such task is still checked
        just before it runs, its lease counted from there."""
        handler = self.handler_of(item)
        return (
            handler is not None
            and not runs_together(handler)
            and len(self.pending) < handler.batch_limit
            and all(self.handler_of(f.item) is handler for f in self.pending)
        )

    def check(self, item: Leased, lease: Lease) -> Task | None:
        """The check of ``lease``, sharing its round trip with the pending outcomes
        (unless they wait for this task's, :meth:`defers`)."""
        session = self.rt.queue.session
        if not self.pending or self.defers(item):
            return session.held(lease, item.data)
        pending, self.pending = self.pending, []
        try:
            written, task = session.write_then_check(
                [f.write for f in pending if f.write is not None], lease, item.data
            )
        except WritesRefused as exc:
            self.settle(pending, self.hold(pending, exc))
            if not self.rt.writes.is_open:
                raise  # the next task must not start
            return session.held(lease, item.data)
        except DatabaseUnavailable as exc:
            self.settle(pending, [exc] * len(pending))
            raise
        except Exception:
            # The server refused the pending outcomes: they are tried, and fail, alone.
            self.pending = pending
            self.flush()
            return session.held(lease, item.data)
        self.settle(pending, list(written))
        return task

    def hold(self, pending: Sequence[Finished], refused: WritesRefused) -> list[bool | Exception]:
        """Try the pending outcomes again, together, while the database refuses writes,
        for as long as their leases last: a refusal shorter than a lease loses no
        outcome and runs nothing twice."""
        gate = self.rt.writes
        gate.refused(refused)
        expires = min(f.done.expires for f in pending)
        while True:
            gate.pause()
            if time.monotonic() >= expires:
                return [refused] * len(pending)
            try:
                return list(self.apply(pending))
            except WritesRefused as again:
                refused = again
            except Exception as exc:
                return [exc] * len(pending)

    def apply(self, pending: Sequence[Finished]) -> Sequence[bool]:
        if len(pending) == 1:
            return [pending[0].write_alone(self.rt)]
        return self.rt.queue.session.apply([f.write for f in pending if f.write is not None])

    def settle(self, pending: Sequence[Finished], written: Sequence[bool | Exception]) -> None:
        if not self.rt.writes.is_open and any(not isinstance(w, Exception) for w in written):
            self.rt.writes.accepted()
        for finished, verdict in zip(pending, written, strict=True):
            with traced(self.trace(finished.item)):
                self.record(finished.item, finished.verdict(verdict))

    def record(self, item: Leased, ran: Ran) -> None:
        """Count and log how a task's run ended (under its trace)."""
        outcome_counter(item.task_class or "unknown", ran.outcome.value).inc()
        line = ran.describe(item.label)
        log.info("%s", line)
        self.ran.append((item, ran, line))
        for observer in observers():
            observer.run_ended(item, ran)

    def flush(self) -> None:
        """Write the pending outcomes, together, in one round trip."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        try:
            written: Sequence[bool | Exception] = self.apply(pending)
        except WritesRefused as exc:
            written = self.hold(pending, exc)
        except Exception as exc:
            written = [exc] * len(pending)
        self.settle(pending, written)


def runs_together(handler: Handler) -> bool:
    """Whether ``handler`` has a call of its own for several tasks (the Conduit proxy's one
    request), so a message's consecutive tasks of it are checked first, then run at once."""
    return handler.batch_limit > 1 and type(handler).run_batch is not Handler.run_batch


def run_task(
    rt: Runtime,
    lease: Lease,
    data_json: str | None = None,
    traceparent: str | None = None,
    task_class: str | None = None,
) -> Ran:
    """Execute one leased task end to end; returns what happened."""
    if lease.failure_count is None:
        raise ValueError("a run is fenced on its lease's failure count; this lease has none")
    batch = Batch(rt, lease.owner, traceparent)
    batch.run([Leased(lease.task_id, lease.failure_count, task_class, data_json)])
    return batch.ran[0][1]
