"""Leased tasks of one owner, run in order, each outcome written fenced by its lease.

A task costs two round trips, the check (one read) and its outcome (one transaction);
in a batch, an outcome travels with the next task's check, so a batch costs one round
trip a task, and nothing runs before the outcome of the task before it is durable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bridge.engine.context import Runtime
from bridge.engine.metrics import UNWRITTEN, outcome_counter
from bridge.engine.run import Done, Ran, attempt, observers, retry_wait
from bridge.engine.tracing import TaskTrace, traced
from bridge.queue import Lease, Outcome, Task
from bridge.queue.model import Leased
from bridge.queue.retry import DatabaseUnavailable, WritesRefused
from bridge.queue.session import (
    Write,
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
        """Run ``items``; once ``budget`` seconds have passed, or once the database refuses
        writes, the rest is returned unrun (still leased, for the caller to send on)."""
        started = time.monotonic()
        gate = self.rt.writes
        for index, item in enumerate(items):
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
            try:
                self.step(item)
            except WritesRefused as exc:
                gate.refused(exc)
                if index:
                    return list(items[index:])
                self.unreported(items, f"not started: {exc}; the lease will expire")
                return []
            except DatabaseUnavailable as exc:
                self.unreported(
                    items[index:], f"database unavailable ({exc}); the lease will expire"
                )
                return []
        self.flush()
        return []

    def unreported(self, items: Sequence[Leased], reason: str) -> None:
        for item in items:
            with traced(self.trace(item)):
                self.record(item, Ran(Outcome.UNREPORTED, reason))

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
        except WritesRefused as exc:
            self.settle(self.hold(exc))
            if not self.rt.writes.is_open:
                raise  # the next task must not start
            return session.held(lease, item.data)
        except DatabaseUnavailable as exc:
            self.settle(exc)
            raise
        except Exception:
            # The server refused the pending outcome: it is tried, and fails, alone.
            self.flush()
            return session.held(lease, item.data)
        self.settle(written[0])
        return task

    def hold(self, refused: WritesRefused) -> bool | Exception:
        """Try the pending outcome again, alone, while the database refuses writes, for
        as long as its lease lasts: a refusal shorter than the lease loses no outcome
        and runs nothing twice."""
        assert self.pending is not None
        gate = self.rt.writes
        gate.refused(refused)
        while True:
            gate.pause()
            if time.monotonic() >= self.pending.done.expires:
                return refused
            try:
                return self.pending.write_alone(self.rt)
            except WritesRefused as again:
                refused = again
            except Exception as exc:
                return exc

    def settle(self, written: bool | Exception) -> None:
        if not isinstance(written, Exception) and not self.rt.writes.is_open:
            self.rt.writes.accepted()
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
        for observer in observers():
            observer.run_ended(item, ran)

    def flush(self) -> None:
        """Write the pending outcome on its own."""
        if self.pending is None:
            return
        try:
            written: bool | Exception = self.pending.write_alone(self.rt)
        except WritesRefused as exc:
            written = self.hold(exc)
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
    if lease.failure_count is None:
        raise ValueError("a run is fenced on its lease's failure count; this lease has none")
    batch = Batch(rt, lease.owner, traceparent)
    batch.run([Leased(lease.task_id, lease.failure_count, task_class, data_json)])
    return batch.ran[0][1]
