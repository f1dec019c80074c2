"""Issue 21's priority scenarios: urgent tasks enqueued behind a backlog, timed the same way
for every consumer.

A backlog is queued in one transaction at a low priority (4000, repository imports). Once
the consumer has archived its first backlog row (so a slow start does not count), the
bench waits ``head_start`` seconds, then queues ``urgent.count`` tasks at priority 1000
(mail), one every ``urgent.every`` seconds, each in a transaction of its own. Meanwhile
it watches the archive for the urgent ids every ``WATCH_INTERVAL`` s:

- enqueue: when the urgent task's INSERT committed;
- archive: when the bench first saw its archive row;
- start: the archive time minus the row's ``duration`` (µs), which every consumer
  (the bridge, the reference taskmaster, phd) writes the same way.

No record of the consumer is used, so phd, which writes none, is timed as the others.
The rest of the backlog is not waited for: the consumer is stopped once every urgent
task is archived.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import MySQLdb

from benchkit import phorgedb, procs
from benchkit.consumers import Consumer
from benchkit.phorgedb import Batch
from benchkit.records import percentile
from benchkit.runner import Workload

WATCH_INTERVAL = 0.01
PROGRESS_EVERY = 1.0  # seconds between two backlog progress reads (a range count)
STALL_TIMEOUT = 60.0  # the run fails when no backlog task is archived for this long
BACKLOG_PRIORITY = 4000  # PhabricatorWorker::PRIORITY_IMPORT


@dataclass(frozen=True)
class Urgent:
    """The urgent tasks and when they come."""

    count: int = 10
    priority: int = 1000  # PhabricatorWorker::PRIORITY_ALERTS
    every: float = 0.5
    head_start: float = 2.0  # after the backlog's first archive
    data_json: str = '{"duration":0.05}'  # short, as mail is: start and archive differ

    def due(self, first_archive: float) -> list[float]:
        """When each urgent task is to be enqueued (``time.time()`` instants)."""
        start = first_archive + self.head_start
        return [start + n * self.every for n in range(self.count)]


@dataclass(frozen=True)
class Spread:
    """The median and the worst of some seconds."""

    p50: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread | None:
        return cls(percentile(values, 0.5), max(values)) if values else None


@dataclass(frozen=True)
class UrgentTask:
    enqueued: float  # the INSERT's COMMIT returned
    archived: float  # the bench saw the archive row
    duration_us: int  # the row's own duration

    @property
    def to_archive(self) -> float:
        return self.archived - self.enqueued

    @property
    def to_start(self) -> float:
        return self.to_archive - self.duration_us / 1_000_000


@dataclass
class PriorityRun:
    backlog: int
    first_archive: float  # seconds from the backlog's COMMIT to its first archive
    urgent: list[UrgentTask]
    backlog_archived: int  # backlog tasks archived when the last urgent one was seen

    @property
    def to_start(self) -> Spread | None:
        return Spread.of([u.to_start for u in self.urgent])

    @property
    def to_archive(self) -> Spread | None:
        return Spread.of([u.to_archive for u in self.urgent])


class Watch:
    """The bench's side of one run: enqueue the urgent tasks on time, see them archived."""

    def __init__(self, conn: MySQLdb.Connection, consumer: Consumer, backlog: Batch) -> None:
        self.conn, self.consumer, self.backlog = conn, consumer, backlog
        self.archived, self.progress_at, self.progress_seen = 0, time.monotonic(), -1

    def check(self) -> None:
        """Raise if the consumer died or the backlog stopped moving; at most once a second."""
        self.consumer.check()
        if time.monotonic() - self.progress_at < PROGRESS_EVERY:
            return
        self.archived = phorgedb.progress(self.conn, self.backlog).archived
        if self.archived != self.progress_seen:
            self.progress_seen, self.progress_at = self.archived, time.monotonic()
        elif time.monotonic() - self.progress_at > STALL_TIMEOUT:
            raise procs.BenchError(
                f"{self.consumer.label}: no backlog task archived for {STALL_TIMEOUT:.0f} s"
                f" ({self.archived} of {self.backlog.size})"
            )

    def first_archive(self) -> float:
        """When the consumer archived its first backlog row (as the bench saw it)."""
        while not phorgedb.progress(self.conn, self.backlog).archived:
            self.check()
            time.sleep(WATCH_INTERVAL)
        return time.time()

    def urgent(self, urgent: Urgent, due: list[float]) -> list[UrgentTask]:
        """Enqueue at each due instant, poll the archive between; until all are archived."""
        enqueued: dict[int, float] = {}
        seen: dict[int, UrgentTask] = {}
        pending = list(due)
        while len(seen) < urgent.count:
            if pending and time.time() >= pending[0]:
                pending.pop(0)
                batch = phorgedb.enqueue(self.conn, 1, urgent.data_json, urgent.priority)
                enqueued[batch.first] = batch.committed
            waiting = [task_id for task_id in enqueued if task_id not in seen]
            for task_id, duration in phorgedb.archived_durations(self.conn, waiting).items():
                seen[task_id] = UrgentTask(enqueued[task_id], time.time(), duration)
            self.check()
            time.sleep(sleep_before(pending, time.time()))
        return [seen[task_id] for task_id in sorted(seen)]


def sleep_before(pending: list[float], now: float) -> float:
    """Until the next watch: ``WATCH_INTERVAL``, or less if an enqueue is due sooner."""
    if not pending:
        return WATCH_INTERVAL
    return max(0.0, min(WATCH_INTERVAL, pending[0] - now))


def run(
    conn: MySQLdb.Connection,
    consumer: Consumer,
    backlog: Workload,
    count: int,
    log: Callable[[str], None],
    urgent: Urgent = Urgent(),
) -> PriorityRun:
    """Queue ``count`` backlog tasks, then the urgent ones; time the urgent ones."""
    batch = phorgedb.enqueue(conn, count, backlog.data_json, BACKLOG_PRIORITY)
    watch = Watch(conn, consumer, batch)
    first = watch.first_archive()
    log(f"{consumer.label}: first backlog archive after {first - batch.committed:.2f} s")
    tasks = watch.urgent(urgent, urgent.due(first))
    archived = phorgedb.progress(conn, batch).archived
    return PriorityRun(count, first - batch.committed, tasks, archived)
