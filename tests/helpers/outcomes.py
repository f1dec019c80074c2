"""A task's outcome written as a worker writes it, for tests that lease by hand.

Each function sends the runtime's own write through the queue's per-task session
(``PhorgeQueue.session``): ``LeaseSession.apply`` with ``bridge.queue.session``'s
outcome writes, or ``LeaseSession.complete`` (which writes follow-ups in the same
transaction) and ``LeaseSession.renew``. Each returns whether the fence held: False
means the lease was no longer held and nothing was written.

``failure_count`` None leaves the failure count out of the fence, as PHP's own checks
do; a worker always passes the count it was dispatched with.
"""

from __future__ import annotations

from collections.abc import Sequence

from bridge.queue import Lease, NewTask, PhorgeQueue
from bridge.queue.model import DEFAULT_RETRY_WAIT
from bridge.queue.session import Write, permanent_failure, temporary_failure, yielded


def _apply(queue: PhorgeQueue, write: Write) -> bool:
    return queue.session.apply([write])[0]


def complete(
    queue: PhorgeQueue,
    task_id: int,
    owner: str,
    duration_us: int,
    followups: Sequence[NewTask] = (),
    *,
    failure_count: int | None = None,
) -> bool:
    """Archive with result 0, with the follow-ups, in one transaction."""
    return queue.session.complete(Lease(task_id, owner, failure_count), duration_us, followups)


def fail_permanent(
    queue: PhorgeQueue, task_id: int, owner: str, *, failure_count: int | None = None
) -> bool:
    """Archive with result 1 and duration 0."""
    return _apply(queue, permanent_failure(Lease(task_id, owner, failure_count)))


def fail_temporary(
    queue: PhorgeQueue,
    task_id: int,
    owner: str,
    wait: int = DEFAULT_RETRY_WAIT,
    *,
    failure_count: int | None = None,
) -> bool:
    """Count a failure and hold the task back ``wait`` seconds; the owner stays."""
    return _apply(queue, temporary_failure(Lease(task_id, owner, failure_count), wait))


def yield_(
    queue: PhorgeQueue, task_id: int, owner: str, seconds: int, *, failure_count: int | None = None
) -> bool:
    """Give the task back for at least 5 seconds without counting a failure."""
    return _apply(queue, yielded(Lease(task_id, owner, failure_count), seconds))


def renew(
    queue: PhorgeQueue, task_id: int, owner: str, seconds: int, *, failure_count: int | None = None
) -> bool:
    """Extend a held lease to now + ``seconds``."""
    return queue.session.renew(Lease(task_id, owner, failure_count), seconds)
