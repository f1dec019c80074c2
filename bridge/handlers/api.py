"""The handler API: what a native Python handler sees and how it reports an outcome.

A handler plays the part of a Phorge ``PhabricatorWorker`` subclass: it serves one or
more task classes, may declare a required lease, a maximum retry count and a wait
before retry, and ends a run in one of Phorge's four ways: return (success, with the
follow-up tasks it queued), raise :class:`Yield`, raise :class:`PermanentFailure`, or
raise anything else (a temporary failure, retried after the wait). Write one as a
:class:`Handler` subclass, or as a plain function with the :func:`handler` decorator.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
from importlib import metadata
from importlib.metadata import packages_distributions
from typing import Any

# The outcome exceptions live with every other error; handlers import them from here.
from bridge.errors import HandBack as HandBack
from bridge.errors import PermanentFailure as PermanentFailure
from bridge.errors import TemporaryFailure as TemporaryFailure
from bridge.errors import Yield as Yield
from bridge.queue.model import NewTask


@dataclass(frozen=True)
class TaskContext:
    """One leased task as a handler sees it: the row's Phorge fields and its decoded data."""

    id: int
    task_class: str
    data: Any
    failure_count: int
    priority: int
    object_phid: str | None = None
    container_phid: str | None = None
    raw_data: InitVar[str | None] = None
    # The execution's W3C trace context: pass it on to what the handler calls.
    traceparent: str | None = None
    # The lease this run holds (its fencing token): one run per lease, so with the id it
    # names this execution (see ``idempotency_key``).
    lease_owner: str | None = None
    # Internals: the stored JSON (for the Conduit proxy), the follow-ups queued so far, and
    # the run time measured where the work ran, when that was not here (the proxy).
    _raw_data: str | None = field(init=False, repr=False, compare=False, default=None)
    _followups: list[NewTask] = field(init=False, repr=False, compare=False, default_factory=list)
    _measured_us: list[int] = field(init=False, repr=False, compare=False, default_factory=list)
    _scheduled: list[int] = field(init=False, repr=False, compare=False, default_factory=list)

    def __post_init__(self, raw_data: str | None) -> None:
        object.__setattr__(self, "_raw_data", raw_data)

    @property
    def idempotency_key(self) -> str:
        """A key naming this execution, the same however often it is read: the task id
        and its lease owner. A run that lost its lease and is run again gets a new key;
        pass it to a service that drops repeats, so a re-run's side effect happens once
        per lease."""
        return f"phorge-task:{self.id}:{self.lease_owner or ''}"

    @property
    def followups(self) -> tuple[NewTask, ...]:
        """The follow-up tasks queued so far, in order; the bridge writes them on success."""
        return tuple(self._followups)

    def queue_task(
        self,
        task_class: str,
        data: Any,
        *,
        priority: int | None = None,
        object_phid: str | None = None,
        container_phid: str | None = None,
        delay_until: int | None = None,
    ) -> None:
        """Queue a follow-up task (Phorge's ``queueTask``): written only on success.

        ``priority`` None means this task's priority (or the default, when the queue
        would refuse this task's own, e.g. 0 written by hand). The follow-up is checked
        now, as the queue will check it: one refused only when the parent is archived
        would undo that archive and run the finished work again.
        """
        followup = NewTask(task_class, data, priority, object_phid, container_phid, delay_until)
        followup.with_default_priority(self.priority).validated()
        self._followups.append(followup)


def stored_data(task: TaskContext) -> str | None:
    """The task's data exactly as Phorge stored it, when the runtime read it (internal:
    the Conduit proxy passes these bytes on to PHP; handlers use ``task.data``)."""
    return task._raw_data


def report_measured_duration(task: TaskContext, duration_us: int) -> None:
    """Record the run time measured where the work ran (internal: the Conduit proxy
    passes on PHP's, which the archive keeps, as ``phd`` would have recorded it)."""
    task._measured_us[:] = [int(duration_us)]


def measured_duration(task: TaskContext) -> int | None:
    return task._measured_us[0] if task._measured_us else None


def report_scheduled(task: TaskContext, count: int) -> None:
    """Record the tasks the run scheduled itself where it ran (internal: PHP's
    ``PhabricatorWorker::scheduleTask``, which no follow-up list returns)."""
    task._scheduled[:] = [max(0, int(count))]


def scheduled(task: TaskContext) -> int:
    return task._scheduled[0] if task._scheduled else 0


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    # Read once: a worker runs the code it imported, whatever is installed later.
    return packages_distributions()


def distribution_version(module: str) -> str | None:
    """``name version`` of the distribution that installed ``module``'s top-level package."""
    names = _distributions().get(module.partition(".")[0])
    return f"{names[0]} {metadata.version(names[0])}" if names else None


class Handler(ABC):
    """Base class for native handlers; subclasses set ``task_classes`` and override ``run``.

    The three policy hooks mirror ``PhabricatorWorker``'s: returning None means "the
    default" (the configured lease, no retry limit, the configured retry backoff).
    ``phorge_defaults`` says the handler stands in for a class Phorge has: its defaults
    are then Phorge's (a flat 300 s wait before retry), so it behaves as under ``phd``.
    """

    task_classes: tuple[str, ...] = ()
    phorge_defaults: bool = False

    @property
    def name(self) -> str:
        """Where the handler is defined, as an entry point names it (``module:qualname``)."""
        return f"{type(self).__module__}:{type(self).__qualname__}"

    @property
    def version(self) -> str | None:
        """The version of the code that runs its classes (``distribution version``: what
        installed the handler's package), None when no distribution did. A canary
        judges a new side afresh from the moment its version changes."""
        return distribution_version(type(self).__module__)

    def required_lease(self, task: TaskContext) -> int | None:
        """Seconds of lease the run needs (Phorge's ``getRequiredLeaseTime``)."""
        return None

    def maximum_retry_count(self, task: TaskContext) -> int | None:
        """Failures after which the next run fails permanently (``getMaximumRetryCount``)."""
        return None

    def wait_before_retry(self, task: TaskContext) -> int | None:
        """Seconds to wait after a temporary failure (``getWaitBeforeRetry``); negative
        makes the task due at once, as in Phorge."""
        return None

    @abstractmethod
    def run(self, task: TaskContext) -> None:
        """Do the work; queue follow-ups with ``task.queue_task``."""


class FunctionHandler(Handler):
    """A handler made by :func:`handler` from a function; calling it calls the function."""

    def __init__(
        self,
        function: Callable[[TaskContext], None],
        task_classes: tuple[str, ...],
        *,
        maximum_retry_count: int | None,
        wait_before_retry: int | None,
        required_lease: int | None,
    ) -> None:
        self.function = function
        self.task_classes = task_classes
        self._maximum_retry_count = maximum_retry_count
        self._wait_before_retry = wait_before_retry
        self._required_lease = required_lease
        functools.update_wrapper(self, function)

    @property
    def name(self) -> str:
        return f"{self.function.__module__}:{self.function.__qualname__}"

    def run(self, task: TaskContext) -> None:
        self.function(task)

    __call__ = run

    def required_lease(self, task: TaskContext) -> int | None:
        return self._required_lease

    def maximum_retry_count(self, task: TaskContext) -> int | None:
        return self._maximum_retry_count

    def wait_before_retry(self, task: TaskContext) -> int | None:
        return self._wait_before_retry


def handler(
    *task_classes: str,
    maximum_retry_count: int | None = None,
    wait_before_retry: int | None = None,
    required_lease: int | None = None,
) -> Callable[[Callable[[TaskContext], None]], FunctionHandler]:
    """Make a handler of ``task_classes`` from a function ``f(task: TaskContext) -> None``.

    The keyword arguments are the policy hooks' answers, the same for every task.
    """
    if not task_classes:
        raise TypeError("handler() needs at least one task class")

    def decorate(function: Callable[[TaskContext], None]) -> FunctionHandler:
        return FunctionHandler(
            function,
            task_classes,
            maximum_retry_count=maximum_retry_count,
            wait_before_retry=wait_before_retry,
            required_lease=required_lease,
        )

    return decorate
