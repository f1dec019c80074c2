"""The queue's vocabulary: Phorge's constants, task records, selectors and their validation.

Field names are snake_case, like the rest of the Python API; Phorge's column names
(``taskClass``, ``leaseOwner``, ...) appear only where rows are mapped:
``bridge.queue.schema`` (``FIELDS``) and ``bridge.queue.statements``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import count
from typing import Any, NamedTuple

from bridge.phorge.php import decode_data, encode_data

YIELD_OWNER = "(yield)"  # PhabricatorWorker::YIELD_OWNER
RESULT_SUCCESS = 0  # PhabricatorWorkerArchiveTask::RESULT_*
RESULT_FAILURE = 1
RESULT_CANCELLED = 2
PRIORITY_DEFAULT = 2000  # PhabricatorWorker::PRIORITY_DEFAULT
DEFAULT_LEASE_SECONDS = 7200  # PhabricatorWorkerLeaseQuery::getDefaultLeaseDuration
DEFAULT_RETRY_WAIT = 300  # PhabricatorWorkerLeaseQuery::getDefaultWaitBeforeRetry
MIN_YIELD_SECONDS = 5  # executeTask: max($ex->getDuration(), 5)
MAX_NAME = 64  # varchar(64) of taskClass and leaseOwner
MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1
# What a bridge lease owner keeps free for the implementation its archive row names
# (``prefix:label:pid:epoch:host:seq``): ``:conduit-fallback~99``, the longest label
# (``bridge.canary.weights.LABEL_ROOM``, which this layer cannot import).
LABEL_ROOM = len(":conduit-fallback~99")


class Outcome(StrEnum):
    """How one run of a task ended: the one vocabulary of the executor, proxy and metrics."""

    SUCCESS = "success"  # archived, result 0
    FAILURE = "failure"  # temporary: failureCount + 1, retried after a wait
    PERMANENT_FAILURE = "permanent-failure"  # archived, result 1
    YIELD = "yield"  # given back for a while, failureCount unchanged
    LEASE_LOST = "lease-lost"  # the fence no longer held: nothing was written
    NOT_SERVED = "not-served"  # no handler here any more: the lease was handed back
    # The handler's transport is unavailable in this worker (its PHP runner cannot boot,
    # its Conduit breaker is open): the lease was handed back at once, nothing counted.
    HANDED_BACK = "handed-back"
    UNREPORTED = "unreported"  # the database stayed unreachable: the lease will expire
    # A canary's new side failed (temporarily or for good): the row went back to
    # the old side (owner NULL, failureTime now), its failure count unchanged.
    FALLBACK = "fallback"


class Lease(NamedTuple):
    """The fence a dispatch carries: a run may write only while all three still match.

    ``failure_count`` tells "leased, not yet run" from "failed and waiting to retry": a
    temporary failure keeps the owner (as Phorge does, labelled with who ran it) but
    counts one more failure. None leaves it out of the fence, as PHP's own checks do
    (operator tools); a worker always has it.
    """

    task_id: int
    owner: str
    failure_count: int | None


class Leased(NamedTuple):
    """A leased task as its Celery message carries it (the owner is the message's)."""

    id: int
    failure_count: int
    task_class: str | None = None
    data: str | None = None  # its JSON, when small enough to travel inline

    @property
    def label(self) -> str:
        return f"{self.task_class}#{self.id}" if self.task_class else f"#{self.id}"


class State(StrEnum):
    """Where a task stands; Phorge has no status column, so this is read off the row."""

    QUEUED = "queued"
    DELAYED = "delayed"
    LEASED = "leased"
    EXPIRED = "lease-expired"  # a lease a crashed or lost worker left behind
    RETRY_WAIT = "waiting-to-retry"
    RETRY_DUE = "retry-due"  # a temporary failure's wait is over
    YIELDED = "yielded"
    YIELD_ENDED = "yield-ended"
    ARCHIVED = "archived"


# The states of rows a poll leases now: queued ones (Phorge's first phase) and those whose
# lease or wait is over (its second, the expired phase).
DUE_STATES = (State.QUEUED, State.EXPIRED, State.RETRY_DUE, State.YIELD_ENDED)


def check_task_class(task_class: Any) -> str:
    if not isinstance(task_class, str) or not task_class:
        raise ValueError(f"task class must be a non-empty string, got {task_class!r}")
    if len(task_class) > MAX_NAME:
        raise ValueError(f"task class {task_class[:20]!r}... is over {MAX_NAME} characters")
    return task_class


def check_priority(priority: Any) -> int:
    valid = isinstance(priority, int) and not isinstance(priority, bool)
    if not valid or not 0 < priority <= MAX_UINT32:
        raise ValueError(f"priority must be a positive integer, got {priority!r}")
    assert isinstance(priority, int)  # ``valid`` above
    return priority


def check_owner(owner: Any) -> str:
    if not isinstance(owner, str) or not owner or len(owner) > MAX_NAME:
        raise ValueError(f"lease owner must be 1 to {MAX_NAME} characters, got {owner!r}")
    if owner == YIELD_OWNER:
        raise ValueError(f"{YIELD_OWNER!r} is Phorge's yield sentinel, not an owner")
    return owner


def check_seconds(name: str, value: Any, minimum: int = 0, maximum: int = MAX_UINT32) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer from {minimum} to {maximum}, got {value!r}")
    return value


_owner_sequence = count(1)


def new_owner(prefix: str, epoch: int) -> str:
    """A lease owner unique to this call, shaped like PHP's ``pid:time:host:sequence``.

    ``epoch`` is the database's clock: it is compared with ``failureTime``
    (``PhorgeQueue.new_owner`` reads it). The host name is cut so that the owner keeps
    :data:`LABEL_ROOM` free for the label its archive row adds, when the prefix allows.
    """
    tail = f":{os.getpid()}:{epoch}:{{host}}:{next(_owner_sequence)}"
    room = MAX_NAME - len(prefix) - len(tail) + len("{host}")
    if room < 1:
        raise ValueError(f"owner prefix {prefix!r} is too long")
    room = max(1, room - LABEL_ROOM)
    # Only the host name is cut: the pid, time and sequence keep the owner unique.
    return check_owner(prefix + tail.format(host=socket.gethostname()[:room]))


@dataclass(frozen=True)
class NewTask:
    """A task to enqueue, with ``PhabricatorWorker::scheduleTask``'s options.

    ``priority`` None means the default (2000); for a follow-up, its parent's priority,
    as Phorge's ``flushTaskQueue`` does.
    """

    task_class: str
    data: Any = None
    priority: int | None = None
    object_phid: str | None = None
    container_phid: str | None = None
    delay_until: int | None = None

    def with_default_priority(self, priority: int) -> NewTask:
        """This task with ``priority`` filled in where none was given.

        A parent's priority the queue would refuse (0, written by hand) falls back to the
        default: a follow-up must never be unqueueable because of its parent.
        """
        if self.priority is not None:
            return self
        try:
            check_priority(priority)
        except ValueError:
            priority = PRIORITY_DEFAULT
        return replace(self, priority=priority)

    def validated(self) -> tuple[NewTask, str]:
        """Check every field before anything is written; return the task (with its
        priority filled in) and its JSON."""
        check_task_class(self.task_class)
        check_priority(PRIORITY_DEFAULT if self.priority is None else self.priority)
        if self.delay_until is not None:
            check_seconds("delay_until", self.delay_until)
        for name in ("object_phid", "container_phid"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, str) or len(value.encode("utf-8")) > MAX_NAME
            ):
                raise ValueError(f"{name} must be a string of at most {MAX_NAME} bytes")
        return self.with_default_priority(PRIORITY_DEFAULT), encode_data(self.data)


@dataclass(frozen=True)
class Task:
    """A row of ``worker_activetask`` or ``worker_archivetask``, with its decoded data.

    Archived rows have ``result``, ``duration`` (µs) and ``archived_epoch`` and no
    ``failure_time``; active rows the reverse. ``server_time`` is the database clock when
    the row was read, so states and remaining leases are judged by the database.
    """

    id: int
    task_class: str
    lease_owner: str | None
    lease_expires: int | None
    failure_count: int
    data_id: int
    priority: int
    object_phid: str | None
    container_phid: str | None
    date_created: int
    date_modified: int
    failure_time: int | None = None
    result: int | None = None
    duration: int | None = None
    archived_epoch: int | None = None
    archived: bool = False
    data: Any = None
    raw_data: str | None = None
    data_error: str | None = None
    server_time: int | None = None

    @property
    def state(self) -> State:
        now = self.server_time if self.server_time is not None else int(time.time())
        if self.archived:
            return State.ARCHIVED
        return state_of(self.lease_owner, self.lease_expires, self.failure_time, now)

    @property
    def lease(self) -> Lease:
        """The fence of this row as read (its id, owner and failure count)."""
        return Lease(self.id, self.lease_owner or "", self.failure_count)

    @property
    def label(self) -> str:
        """How a task is named in logs, Flower and the CLI."""
        return f"{self.task_class}#{self.id}"


def task_from_row(fields: dict[str, Any], archived: bool = False) -> Task:
    """A Task from a row read with ``statements.task_columns``' labels; data read as
    bytes is decoded here, one row at a time."""
    for name in ("object_phid", "container_phid"):  # varbinary: bytes from the bare driver
        if isinstance(fields.get(name), bytes):
            fields[name] = fields[name].decode("utf-8", "replace")
    if "raw_data" not in fields:
        return Task(**fields, archived=archived)
    raw = fields.pop("raw_data")
    data, error = decode_data(raw)
    if isinstance(raw, bytes):
        raw = None if error and "UTF-8" in error else raw.decode("utf-8")
    return Task(**fields, archived=archived, data=data, raw_data=raw, data_error=error)


def lease_epoch(owner: str | None) -> int | None:
    """When the lease was taken, from the owner string's epoch (third field from the end)."""
    parts = (owner or "").split(":")
    return int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None


def label_of(owner: str | None) -> str | None:
    """The implementation a lease owner names: its fifth field from the end
    (``phd:pid:epoch:host:seq``, ``bridge:native:pid:epoch:host:seq``); None for owners
    without one (Phorge's own taskmasters: ``pid:epoch:host:seq``)."""
    if owner is None:
        return None
    fields = owner.split(":")
    return fields[-5] if len(fields) >= 5 else None


def state_of(owner: str | None, expires: int | None, failure_time: int | None, now: int) -> State:
    """The state of an active row (the same rule as ``statements.state_case``)."""
    if owner is None:
        return State.DELAYED if expires is not None and expires > now else State.QUEUED
    due = expires is None or expires <= now
    if owner == YIELD_OWNER:
        return State.YIELD_ENDED if due else State.YIELDED
    # A failure keeps the failed run's owner: the row waits to retry until re-leased.
    leased_at = lease_epoch(owner)
    if failure_time is not None and (leased_at is None or leased_at <= failure_time):
        return State.RETRY_DUE if due else State.RETRY_WAIT
    return State.EXPIRED if due else State.LEASED


@dataclass(frozen=True)
class TaskFilter:
    """``bin/worker``'s task selectors; every given constraint must hold."""

    ids: Sequence[int] | None = None
    classes: Sequence[str] | None = None
    active: bool = False
    archived: bool = False
    container_phids: Sequence[str] | None = None
    object_phids: Sequence[str] | None = None
    min_failure_count: int | None = None
    max_failure_count: int | None = None
    min_priority: int | None = None
    max_priority: int | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.active and self.archived:
            raise ValueError("a task cannot be both active and archived")
        for low, high, what in (
            (self.min_failure_count, self.max_failure_count, "failure count"),
            (self.min_priority, self.max_priority, "priority"),
        ):
            if low is not None and high is not None and low > high:
                raise ValueError(f"minimum {what} {low} is larger than the maximum {high}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"limit must be a positive integer, got {self.limit!r}")

    @property
    def constrained(self) -> bool:
        """Whether any selector is set (``bin/worker`` refuses to act on everything)."""
        return any(
            value is not None and value is not False
            for value in (
                self.ids,
                self.classes,
                self.active,
                self.archived,
                self.container_phids,
                self.object_phids,
                self.min_failure_count,
                self.max_failure_count,
                self.min_priority,
                self.max_priority,
            )
        )


@dataclass(frozen=True)
class InFlight:
    """One class's live leases of the poller's owners: how many, and the largest priority
    number among them (an urgent row is one with a smaller number than this)."""

    count: int
    worst_priority: int


@dataclass(frozen=True)
class RecentRuns:
    """The archive's most recent runs of some classes, to estimate throughput
    (``count / span``) and mean duration (``duration_us / count``).

    ``span`` is in seconds, from the oldest counted row's ``dateModified`` (or the
    oldest row read, when the read was cut short) to the database's now, at least 1 (1
    when nothing was counted). Both are whole seconds, each about half a second late on
    average, so their difference is the time the rows cover, unbiased; ``count / span``
    is at most the rows read per second (``PhorgeQueue.recent_runs``' ``limit``).
    """

    count: int
    duration_us: int
    span: int


@dataclass(frozen=True)
class ActionResult:
    """What an operator action did to one task; ``reason`` names a refusal as bin/worker."""

    id: int
    label: str
    done: bool
    reason: str = ""


@dataclass
class QueueStats:
    """Queue depth and age as the database sees it (Flower only sees the broker)."""

    server_time: int
    by_class: dict[str, dict[str, int]] = field(default_factory=dict)
    archived_window: int = 0
    oldest_queued_age: int | None = None

    def total(self, state: str) -> int:
        return sum(states.get(state, 0) for states in self.by_class.values())
