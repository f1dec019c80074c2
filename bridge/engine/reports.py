"""The values a task's run hands on, from its check to its written outcome: checked
(:class:`CheckedTask`), cleared to run (:class:`ClearedTask`), ended with an outcome to
write (:class:`PendingOutcome`), or ended with nothing left to write (:class:`RunReport`,
what callers, observers and the metrics are told). They import no step of the run, so
every step and every observer can use them without an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from bridge.canary.weights import run_label
from bridge.engine.sides import archive_owner
from bridge.engine.tracing import TaskTrace
from bridge.handlers.api import Handler, TaskContext
from bridge.handlers.outcome import HandlerResult
from bridge.queue import Lease, Outcome, Task
from bridge.queue.model import Leased


class CheckedTask(NamedTuple):
    """A message's task as its check found it, just before its run: the lease it runs
    under, its row (None: the lease no longer held) and the trace its log lines carry."""

    item: Leased
    lease: Lease
    task: Task | None
    trace: TaskTrace


@dataclass(frozen=True)
class ClearedTask:
    """A checked task cleared to run: its handler and context, the lease seconds it has
    left and the seconds its run may keep the lease renewed; who runs it (its archive
    label) and, for a new-side run of a shared class, who takes it should it fail, and
    the task's age when a yield of it would be a yield loop (``sides.yield_loop_age``)."""

    lease: Lease
    label: str
    handler: Handler
    ctx: TaskContext
    remaining: int
    budget: int
    implementation: str = ""
    fallback_to: str | None = None
    yield_loop_age: int | None = None


@dataclass(frozen=True)
class RunReport:
    """How one execution ended: the outcome written (or why none was), the handler's
    reason and, for a failure or a yield, the seconds until the task is due again; for a
    failure, what the handler raised (``HandlerResult.error``); the implementation that
    ran it, as its archive row names it (``native``, ``runner``, ``conduit``, with
    ``-fallback`` for the old side's run of a row the new side failed), None when no
    handler was chosen."""

    outcome: Outcome
    reason: str = ""
    wait: int | None = None
    error: Exception | None = None
    implementation: str | None = None

    def describe(self, label: str) -> str:
        """One line, the same in the worker log, Flower and ``phorge-bridge execute``:
        ``Class#id [native]: success``."""
        ran_by = f" [{self.implementation}]" if self.implementation else ""
        text = f"{label}{ran_by}: {self.outcome}"
        if self.reason:
            text += f": {self.reason}"
        if self.wait is not None:
            text += f" (due again in {self.wait} s)"
        return text


@dataclass(frozen=True)
class PendingOutcome:
    """A run whose outcome is ready to be written under its lease, which runs out at
    ``expires`` (monotonic time): a refused write is tried again until then.
    ``implementation``: who ran it (:class:`RunReport`), which its archive row names;
    ``handler``: the handler that ran it (None when it ended before a run), whose
    outcomes may share a commit."""

    lease: Lease
    result: HandlerResult
    expires: float
    ctx: TaskContext | None = None
    implementation: str | None = None
    handler: Handler | None = None

    @property
    def archived_as(self) -> str | None:
        """The owner its archive row gets: the lease's, labelled with who ran it and the
        tasks it queued (``weights.run_label``)."""
        if self.implementation is None:
            return None
        label = run_label(self.implementation, self.result.effects)
        return archive_owner(self.lease.owner, label)


# A run that ended before its outcome was written: with one to write, or with none.
Ended = PendingOutcome | RunReport
