"""The handler API: what a native Python handler sees and how it reports an outcome.

A handler plays the part of a Phorge ``PhabricatorWorker`` subclass: it serves one or
more task classes, may declare a required lease, a maximum retry count and a wait
before retry, and ends a run in one of Phorge's four ways: return (success, with the
follow-up tasks it queued), raise :class:`Yield`, raise :class:`PermanentFailure`, or
raise anything else (a temporary failure, retried after the wait).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from bridge.model import NewTask


@dataclass(frozen=True)
class FollowUp:
    """A task queued by a handler, enqueued only if (and when) its parent succeeds.

    ``priority`` None means "the parent's priority", as Phorge's ``flushTaskQueue``.
    """

    taskClass: str
    data: Any
    priority: int | None = None
    objectPHID: str | None = None
    containerPHID: str | None = None
    delayUntil: int | None = None

    def as_new_task(self, parent_priority: int) -> NewTask:
        """The task to enqueue, with the parent's priority when none was given."""
        priority = parent_priority if self.priority is None else self.priority
        return NewTask(
            self.taskClass,
            self.data,
            priority,
            self.objectPHID,
            self.containerPHID,
            self.delayUntil,
        )


@dataclass
class TaskContext:
    """One leased task as a handler sees it (the row's Phorge fields and its decoded data)."""

    id: int
    taskClass: str
    data: Any
    failureCount: int
    priority: int
    objectPHID: str | None = None
    containerPHID: str | None = None
    leaseOwner: str | None = None
    rawData: str | None = None
    followups: list[FollowUp] = field(default_factory=list)

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

        Checked now, as the queue will check it: a follow-up refused only when the parent
        is archived would undo that archive and run the finished work again.
        """
        followup = FollowUp(task_class, data, priority, object_phid, container_phid, delay_until)
        followup.as_new_task(self.priority).validated()
        self.followups.append(followup)


class Yield(Exception):
    """Give the task back for ``seconds`` (at least 5) without counting a failure."""

    def __init__(self, seconds: int, message: str = "") -> None:
        super().__init__(message or f"yielded for {seconds}s")
        self.seconds = int(seconds)


class PermanentFailure(Exception):
    """Archive the task with result 1 (failure); it is never retried."""


class TemporaryFailure(Exception):
    """Retry the task later; ``wait`` (seconds) overrides the handler's wait before retry."""

    def __init__(self, message: str, wait: int | None = None) -> None:
        super().__init__(message)
        self.wait = wait


class Handler(ABC):
    """Base class for native handlers; subclasses set ``task_classes`` and override ``run``.

    The three policy hooks mirror ``PhabricatorWorker``'s: returning None means "the
    default" (the configured lease, no retry limit, the configured retry backoff).
    """

    task_classes: ClassVar[tuple[str, ...]] = ()

    def required_lease(self, task: TaskContext) -> int | None:
        """Seconds of lease the run needs (Phorge's ``getRequiredLeaseTime``)."""
        return None

    def maximum_retry_count(self, task: TaskContext) -> int | None:
        """Failures after which the next run fails permanently (``getMaximumRetryCount``)."""
        return None

    def wait_before_retry(self, task: TaskContext) -> int | None:
        """Seconds to wait after a temporary failure (``getWaitBeforeRetry``)."""
        return None

    @abstractmethod
    def run(self, task: TaskContext) -> None:
        """Do the work; queue follow-ups with ``task.queue_task``."""
