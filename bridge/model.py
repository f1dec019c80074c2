"""The queue's vocabulary: Phorge's constants, task records, selectors and their validation.

Field names are Phorge's column names on purpose: they are wire format shared with PHP.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import count
from typing import Any

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


class State(StrEnum):
    """Where a task stands; Phorge has no status column, so this is read off the row."""

    QUEUED = "queued"
    DELAYED = "delayed"
    LEASED = "leased"
    EXPIRED = "lease-expired"
    RETRY_WAIT = "waiting-to-retry"
    YIELDED = "yielded"
    ARCHIVED = "archived"


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


PHP_MAX_DEPTH = 511  # json_decode's default depth (512) counts one past the deepest array
PHP_INT = range(-(2**63), 2**63)


def _check_php_readable(data: Any) -> None:
    """Refuse what PHP's ``json_decode`` would silently read as null or a float."""
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list | tuple):
            if depth >= PHP_MAX_DEPTH:
                raise ValueError(f"nested deeper than the {PHP_MAX_DEPTH} levels PHP decodes")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                stack.append((key, depth + 1))
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate") from None
        elif isinstance(value, int) and not isinstance(value, bool) and value not in PHP_INT:
            raise ValueError(f"integer {value} is outside PHP's 64-bit range")


def encode_data(data: Any) -> str:
    """JSON that PHP's ``json_decode`` reads back unchanged (integers never become floats)."""
    try:
        _check_php_readable(data)
        return json.dumps(data, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"task data cannot be encoded as JSON for PHP: {exc}") from None


def _refuse_constant(name: str) -> Any:
    # PHP's json_decode rejects NaN and Infinity; so must we.
    raise ValueError(f"{name} is not JSON")


def decode_data(raw: str | None) -> tuple[Any, str | None]:
    """Decode a data row; corrupt JSON is reported as an error string, never raised."""
    if raw is None:
        return None, "the task's data row is missing"
    try:
        return json.loads(raw, parse_constant=_refuse_constant), None
    except ValueError as exc:
        return None, f"the task's data row is not valid JSON: {exc}"


_owner_sequence = count(1)


def new_owner(prefix: str = "bridge") -> str:
    """A lease owner unique to this call, shaped like PHP's ``pid:time:host:sequence``."""
    tail = f":{os.getpid()}:{int(time.time())}:{{host}}:{next(_owner_sequence)}"
    room = MAX_NAME - len(prefix) - len(tail) + len("{host}")
    if room < 1:
        raise ValueError(f"owner prefix {prefix!r} is too long")
    # Only the host name is cut: the pid, time and sequence keep the owner unique.
    return check_owner(prefix + tail.format(host=socket.gethostname()[:room]))


@dataclass(frozen=True)
class NewTask:
    """A task to enqueue, with ``PhabricatorWorker::scheduleTask``'s options."""

    taskClass: str
    data: Any = None
    priority: int = PRIORITY_DEFAULT
    objectPHID: str | None = None
    containerPHID: str | None = None
    delayUntil: int | None = None

    def validated(self) -> tuple[NewTask, str]:
        """Check every field before anything is written; return the task and its JSON."""
        check_task_class(self.taskClass)
        check_priority(self.priority)
        if self.delayUntil is not None:
            check_seconds("delayUntil", self.delayUntil)
        for name in ("objectPHID", "containerPHID"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, str) or len(value.encode("utf-8")) > MAX_NAME
            ):
                raise ValueError(f"{name} must be a string of at most {MAX_NAME} bytes")
        return self, encode_data(self.data)


@dataclass(frozen=True)
class Task:
    """A row of ``worker_activetask`` or ``worker_archivetask``, with its decoded data.

    Archived rows have ``result``, ``duration`` (µs) and ``archivedEpoch`` and no
    ``failureTime``; active rows the reverse. ``serverTime`` is the database clock when
    the row was read, so states and remaining leases are judged by the database.
    """

    id: int
    taskClass: str
    leaseOwner: str | None
    leaseExpires: int | None
    failureCount: int
    dataID: int
    priority: int
    objectPHID: str | None
    containerPHID: str | None
    dateCreated: int
    dateModified: int
    failureTime: int | None = None
    result: int | None = None
    duration: int | None = None
    archivedEpoch: int | None = None
    archived: bool = False
    data: Any = None
    rawData: str | None = None
    dataError: str | None = None
    serverTime: int | None = None

    @property
    def state(self) -> State:
        now = self.serverTime if self.serverTime is not None else int(time.time())
        if self.archived:
            return State.ARCHIVED
        return classify(self.leaseOwner, self.leaseExpires, self.failureTime, now)

    @property
    def label(self) -> str:
        """How a task is named in logs, Flower and the CLI."""
        return f"{self.taskClass}#{self.id}"


def lease_epoch(owner: str | None) -> int | None:
    """When the lease was taken, from the owner string's epoch (third field from the end)."""
    parts = (owner or "").split(":")
    return int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None


def classify(owner: str | None, expires: int | None, failure_time: int | None, now: int) -> State:
    """The state of an active row (the same rule as ``statements.state_case``)."""
    if owner is None:
        return State.DELAYED if expires is not None and expires > now else State.QUEUED
    if expires is None or expires <= now:
        return State.EXPIRED
    if owner == YIELD_OWNER:
        return State.YIELDED
    # A failure keeps the failed run's owner: the row waits to retry until re-leased.
    leased_at = lease_epoch(owner)
    if failure_time is not None and (leased_at is None or leased_at <= failure_time):
        return State.RETRY_WAIT
    return State.LEASED


@dataclass(frozen=True)
class TaskFilter:
    """``bin/worker``'s task selectors; every given constraint must hold."""

    ids: Sequence[int] | None = None
    classes: Sequence[str] | None = None
    active: bool = False
    archived: bool = False
    containerPHIDs: Sequence[str] | None = None
    objectPHIDs: Sequence[str] | None = None
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
                self.containerPHIDs,
                self.objectPHIDs,
                self.min_failure_count,
                self.max_failure_count,
                self.min_priority,
                self.max_priority,
            )
        )


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

    serverTime: int
    by_class: dict[str, dict[str, int]] = field(default_factory=dict)
    archived_window: int = 0
    oldest_queued_age: int | None = None

    def total(self, state: str) -> int:
        return sum(states.get(state, 0) for states in self.by_class.values())
