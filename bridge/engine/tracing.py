"""Trace context of one execution: a W3C ``traceparent`` and the task it belongs to.

The poller puts a ``traceparent`` in each message's headers (any other sender may too;
the tasks of a batch share their message's); the execution keeps it, or makes a new
one, sends it to Phorge with ``worker.execute`` and to feed hook receivers, and
:class:`TaskLogFilter` appends it, with the task's id, class and lease owner, to every
log line written while the task runs, so one grep follows a task from the poll to its
outcome.
"""

from __future__ import annotations

import logging
import re
import secrets
from contextvars import ContextVar, Token
from dataclasses import dataclass

TRACEPARENT_HEADER = "traceparent"
# version 00: trace-id (32 hex, not all zero), parent-id (16 hex, not all zero), flags.
_TRACEPARENT = re.compile(r"\A00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}\Z")


def new_traceparent() -> str:
    """A fresh, sampled W3C traceparent."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def traceparent_or_new(value: object) -> str:
    """The sender's traceparent when it is a valid one, else a new one."""
    if isinstance(value, str) and _TRACEPARENT.match(value.strip().lower()):
        return value.strip().lower()
    return new_traceparent()


@dataclass(frozen=True)
class TaskTrace:
    """What every log line about a task carries."""

    task_id: int
    task_class: str | None
    owner: str
    traceparent: str

    def tag(self) -> str:
        return (
            f"[task={self.task_id} class={self.task_class or '?'} owner={self.owner} "
            f"traceparent={self.traceparent}]"
        )


_current: ContextVar[TaskTrace | None] = ContextVar("phorge_task_trace", default=None)


def current_trace() -> TaskTrace | None:
    return _current.get()


def begin_trace(trace: TaskTrace) -> Token[TaskTrace | None]:
    """Tag the log lines written from now on with ``trace``, until :func:`end_trace`."""
    return _current.set(trace)


def end_trace(token: Token[TaskTrace | None]) -> None:
    _current.reset(token)


class traced:
    """Tag the log lines written inside the block with ``trace``.

    A class, not a generator: every task enters it, and this costs a third as much."""

    __slots__ = ("_token", "trace")

    def __init__(self, trace: TaskTrace) -> None:
        self.trace = trace

    def __enter__(self) -> TaskTrace:
        self._token = begin_trace(self.trace)
        return self.trace

    def __exit__(self, *_: object) -> None:
        end_trace(self._token)


class TaskLogFilter(logging.Filter):
    """Appends the current task's tag to a record's message (once, whatever the handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        trace = _current.get()
        if trace is not None and not getattr(record, "phorge_task", None):
            record.msg = f"{record.getMessage()} {trace.tag()}"
            record.args = ()
            record.phorge_task = trace.task_id
        return True


def tag_log_lines(logger: logging.Logger | None = None) -> None:
    """Install :class:`TaskLogFilter` on the handlers of ``logger`` (default: the root)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, TaskLogFilter) for f in handler.filters):
            handler.addFilter(TaskLogFilter())
