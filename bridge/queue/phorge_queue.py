"""PhorgeQueue: Phorge's task queue, read and written exactly as Phorge's PHP does.

It runs the statements of ``bridge.queue.statements`` in the right transactions for the
runtime's path: enqueue, lease, the per-task session (``LeaseSession``: check, renew,
outcomes, follow-ups written through :meth:`PhorgeQueue._complete_with`), and the reads.
``bin/worker``'s operator actions build on it in ``bridge.queue.actions``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, Row
from sqlalchemy.exc import SQLAlchemyError

from bridge.queue import statements as sql
from bridge.queue.dialect import is_mysql, lock_engine, lock_key, make_engine, next_task_ids
from bridge.queue.model import (
    DEFAULT_LEASE_SECONDS,
    PRIORITY_DEFAULT,
    RESULT_SUCCESS,
    InFlight,
    Lease,
    Leased,
    NewTask,
    QueueStats,
    RecentRuns,
    Task,
    TaskFilter,
    check_owner,
    check_seconds,
    new_owner,
    task_from_row,
)
from bridge.queue.retry import retrying
from bridge.queue.schema import metadata
from bridge.queue.schema import worker_activetask as active_table
from bridge.queue.schema import worker_archivetask as archive_table
from bridge.queue.session import LeaseSession

log = logging.getLogger(__name__)
T = TypeVar("T")

# Seconds after its lease a lease that no live run holds stops counting as in flight: a
# paced queue's message starts within about a run or two, and a dead worker's messages
# come back from the broker at once (``bridge.engine.redelivery``), so a lease unrun
# this long had its message lost (or a worker whose broker still waits on it).
STRANDED_AFTER = 30
# One lease phase: (conn, limit, owner, seconds, where) -> rows won.
_TakePhase = Callable[[Connection, int, str, int, sql.LeaseFilter], int]


def _task(row: Row[Any], archived: bool = False) -> Task:
    return task_from_row(row._asdict(), archived)


def _utf8(raw: bytes | None) -> str | None:
    """Data to send inline; None (read and judged by the worker) when not UTF-8."""
    try:
        return raw.decode("utf-8") if raw is not None else None
    except UnicodeDecodeError:
        return None


class RangeSizes:
    """Whether the index ranges a lease would read are small (at most ``bound`` rows,
    counted by ``sql.count_class_rows`` and ``sql.count_expired_range``), to pick each
    candidate SELECT's index. A class is counted again after ``ttl`` seconds, so polls
    many times a second share one count. A wrong answer only makes a poll slower,
    never its rows different.
    """

    def __init__(self, ttl: float = 5.0, bound: int = sql.SMALL_CLASS_ROWS) -> None:
        self.ttl = ttl
        self.bound = bound
        self._known: dict[str, tuple[bool, float]] = {}  # class -> (small, counted until)

    def small_classes(self, engine: Engine, classes: Sequence[str]) -> frozenset[str]:
        now = time.monotonic()
        stale = [name for name in dict.fromkeys(classes) if self._until(name) <= now]
        if stale:
            with engine.connect() as conn:
                for name, rows in conn.execute(sql.count_class_rows(stale, self.bound)):
                    self._known[name] = (rows <= self.bound, now + self.ttl)
        return frozenset(name for name in classes if self._known[name][0])

    def few_expired(self, conn: Connection) -> bool:
        """Whether few rows have a past ``leaseExpires`` (usually none): then reading
        them all in expiry order beats reading each small class's rows."""
        expired: int = conn.execute(sql.count_expired_range(self.bound)).scalar_one()
        return expired <= self.bound

    def _until(self, name: str) -> float:
        return self._known[name][1] if name in self._known else 0.0


@contextmanager
def named_lock(engine: Engine, name: str) -> Iterator[int | None]:
    """Hold the lock ``name`` for the block; yields the database time, or None when
    another process holds it (MySQL's ``GET_LOCK``, per server, so per database name
    too). SQLite, the single-process embedded default, has no such lock, and needs none.

    The lock is held on a connection of :func:`lock_engine`'s, whose session the server
    ends after 10 s of silence: a holder whose host vanished (a frozen or unplugged host
    sends no FIN) frees the lock then, not after the server's ``wait_timeout`` of hours,
    which would stop every poll.
    """
    with lock_engine(engine).connect() as conn:
        if not is_mysql(engine):
            yield int(conn.execute(sql.server_time()).scalar_one())
            return
        key = lock_key(engine, name)
        got, now = conn.execute(sql.get_lock(key)).one()
        try:
            yield int(now) if got else None
        finally:
            try:
                if got:
                    conn.execute(sql.release_lock(key))
            except SQLAlchemyError as exc:  # the server ended the session: the lock went with it
                log.warning("named lock %s: its session ended while held: %s", key, exc)
                conn.invalidate()


class PhorgeQueue:
    """The worker queue of one Phorge install (one ``{namespace}_worker`` database)."""

    def __init__(self, engine: Engine, attempts: int = 5) -> None:
        self.engine = engine
        self.attempts = attempts  # tries of a transaction through transient errors
        self._sessions = threading.local()
        self.range_sizes = RangeSizes()  # picks the index of each candidate SELECT

    @classmethod
    def from_url(cls, url: str, attempts: int = 5, **kwargs: Any) -> PhorgeQueue:
        return cls(make_engine(url, **kwargs), attempts)

    def create_tables(self) -> None:
        """Create Phorge's four tables if missing (tests and the embedded default only)."""
        metadata.create_all(self.engine)

    @property
    def session(self) -> LeaseSession:
        """This thread's session for the per-task path (one connection, held)."""
        session = getattr(self._sessions, "session", None)
        if session is None:
            session = LeaseSession(self.engine, self._complete_with, self.attempts)
            self._sessions.session = session
        return session

    def dispose(self) -> None:
        """Close this thread's session and the pool (process exit, tests)."""
        session = getattr(self._sessions, "session", None)
        if session is not None:
            session.close()
            self._sessions.session = None
        self.engine.dispose()

    def transaction(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in one transaction, again after a transient error (``retry``):
        ``work`` must be safe to run again (the operator actions run through this too)."""

        def attempt() -> T:
            with self.engine.connect() as conn:
                conn.execution_options(bridge_write=True)
                with conn.begin():
                    return work(conn)

        return retrying("transaction", attempt, self.attempts)

    def poll_lock(self, name: str) -> AbstractContextManager[int | None]:
        """Hold the poll lock ``name`` for the block (:func:`named_lock`)."""
        return named_lock(self.engine, name)

    def server_time(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sql.server_time()).scalar_one())

    def probe_writes(self) -> None:
        """Raise ``WritesRefused`` while the database refuses writes (changes nothing)."""
        self.transaction(lambda conn: conn.execute(sql.probe_writes()))

    # -- enqueue ------------------------------------------------------------------------

    def enqueue(
        self,
        task_class: str,
        data: Any = None,
        *,
        priority: int | None = None,
        delay_until: int | None = None,
        object_phid: str | None = None,
        container_phid: str | None = None,
    ) -> int:
        """Queue one task as ``PhabricatorWorker::scheduleTask`` would; returns its id."""
        task = NewTask(
            task_class,
            data,
            PRIORITY_DEFAULT if priority is None else priority,
            object_phid,
            container_phid,
            delay_until,
        )
        return self.enqueue_many([task])[0]

    def enqueue_many(self, tasks: Iterable[NewTask]) -> list[int]:
        """Queue tasks atomically: every data and active row, or none of them."""
        checked = [task.validated() for task in tasks]
        if not checked:
            return []
        return self.transaction(lambda conn: self._insert_tasks(conn, checked))

    def _insert_tasks(self, conn: Connection, checked: list[tuple[NewTask, str]]) -> list[int]:
        # The counter is taken inside this transaction: its row stays locked until commit,
        # which keeps ids and rows atomic at the cost of serialising concurrent enqueuers.
        ids = next_task_ids(conn, len(checked))
        for task_id, (task, data_json) in zip(ids, checked, strict=True):
            key = conn.execute(sql.insert_data(data_json)).inserted_primary_key
            assert key is not None  # one row inserted (no executemany): its key is there
            data_id = key[0]
            conn.execute(sql.insert_active(task_id, data_id, task))
        return ids

    # -- lease --------------------------------------------------------------------------

    def new_owner(self, prefix: str = "bridge", now: int | None = None) -> str:
        """A lease owner unique to this call, its epoch the database's clock (``now``,
        when the caller has just read it): the owner's epoch is compared with
        ``failureTime``, so a host clock would misjudge a task waiting to retry."""
        return new_owner(prefix, self.server_time() if now is None else now)

    def lease(
        self,
        limit: int,
        seconds: int = DEFAULT_LEASE_SECONDS,
        *,
        owner_prefix: str = "bridge",
        classes: Sequence[str] | None = None,
        exclude_classes: Sequence[str] | None = None,
        ids: Sequence[int] | None = None,
        expired_first: bool = False,
    ) -> list[Task]:
        """Lease up to ``limit`` tasks in Phorge's two phases under a new owner (see
        :meth:`new_owner`); returns only the rows this call won, each with its
        ``lease_owner``.

        The final read selects the rows held by the owner, as PHP does. ``ids`` restricts
        both phases to those tasks (``PhabricatorWorkerLeaseQuery::withIDs``).
        ``expired_first`` runs the expired phase first, so lost dispatches come back
        before the backlog.
        """
        owner = self.new_owner(owner_prefix)
        where = sql.LeaseFilter(classes, exclude_classes, ids)
        if not self._take(limit, owner, seconds, where, expired_first):
            return []
        with self.engine.connect() as conn:
            return [_task(row) for row in conn.execute(sql.select_leased(owner)).all()]

    def lease_to_send(
        self,
        limit: int,
        owner_prefix: str,
        seconds: int,
        classes: Sequence[str],
        inline_max: int,
        *,
        now: int | None = None,
        priority_below: int | None = None,
        shares: Mapping[str, int] | None = None,
    ) -> tuple[str, list[Leased]]:
        """The poll's lease: as :meth:`lease` with ``expired_first``, returning the owner
        and the rows as their messages carry them, data undecoded and only up to
        ``inline_max`` bytes (the worker decodes it, or reads a larger one, when it checks
        the lease). ``now``: the database's clock, when the poll has just read it.
        ``priority_below``: only rows with a smaller priority number (the urgent lane).
        ``shares``: classes shared with phd in a canary, with the bridge's weight
        (basis points): only the bridge's share of their rows (``sql.LeaseFilter``)."""
        owner = self.new_owner(owner_prefix, now)
        where = sql.LeaseFilter(classes, priority_below=priority_below, shares=shares or {})
        if not self._take(limit, owner, seconds, where, expired_first=True):
            return owner, []
        with self.engine.connect() as conn:
            rows = conn.execute(sql.select_leased_to_send(owner, inline_max)).all()
        return owner, [Leased(r.id, r.failure_count, r.task_class, _utf8(r.raw_data)) for r in rows]

    def _take(
        self, limit: int, owner: str, seconds: int, where: sql.LeaseFilter, expired_first: bool
    ) -> int:
        """Phorge's two lease phases, each its own transaction; returns the rows won."""
        check_owner(owner)
        check_seconds("lease seconds", seconds, minimum=1)
        if limit <= 0 or any(s is not None and not s for s in (where.classes, where.ids)):
            return 0
        if where.classes is not None and where.ids is None:
            # Counted once for both phases: which classes read through ``taskClass``.
            small = self.range_sizes.small_classes(self.engine, where.classes)
            where = replace(where, small_classes=small)
        phases: list[_TakePhase] = [self._take_unleased, self._take_expired]
        won = 0
        for take_phase in reversed(phases) if expired_first else phases:
            # A def, not a lambda: mypy cannot type a lambda with defaults (mypy#15459).
            def phase(conn: Connection, take: _TakePhase = take_phase, n: int = limit - won) -> int:
                return take(conn, n, owner, seconds, where)

            won += self.transaction(phase)
            if won >= limit:
                break
        return won

    @staticmethod
    def _take_unleased(
        conn: Connection, limit: int, owner: str, seconds: int, where: sql.LeaseFilter
    ) -> int:
        rows = conn.execute(sql.select_unleased(limit, where)).all()
        ids = [row.id for row in rows]
        return conn.execute(sql.take_unleased(ids, owner, seconds)).rowcount if ids else 0

    def _take_expired(
        self, conn: Connection, limit: int, owner: str, seconds: int, where: sql.LeaseFilter
    ) -> int:
        if where.small_classes and self.range_sizes.few_expired(conn):
            where = replace(where, small_classes=frozenset())
        rows = conn.execute(sql.select_expired(limit, where)).all()
        return conn.execute(sql.take_expired(rows, owner, seconds)).rowcount if rows else 0

    def in_flight_by_class(
        self, owner_prefix: str, classes: Sequence[str] | None = None
    ) -> dict[str, InFlight]:
        """Live, running leases per task class of every owner ``owner_prefix:...``, only
        of ``classes`` when given (cheaper: other classes' rows are never read). On
        MySQL a lease :data:`STRANDED_AFTER` seconds old that no live run holds
        (``run_locks``) is not counted: its message was lost or its worker is gone, and
        it must not hold the queue's pace until it expires."""
        if classes is not None and not classes:
            return {}
        stranded_after = STRANDED_AFTER if is_mysql(self.engine) else None
        with self.engine.connect() as conn:
            query = sql.count_in_flight_by_class(owner_prefix, classes, stranded_after)
            rows = conn.execute(query).all()
        return {task_class: InFlight(count, worst) for task_class, count, worst in rows}

    def recent_runs(self, classes: Sequence[str], window: int, limit: int = 500) -> RecentRuns:
        """The runs of ``classes`` (any result) among the newest ``limit`` rows archived
        in the last ``window`` seconds: the poller's throughput estimate.

        The span runs from the oldest run counted, or, when ``limit`` rows were read
        (the window holds more), from the oldest row read: the time those rows cover.
        """
        if not classes:
            return RecentRuns(0, 0, 1)
        with self.engine.connect() as conn:
            query = sql.sum_recent_runs(classes, window, limit)
            count, duration, oldest_ours, read, oldest_read, now = conn.execute(query).one()
        oldest = oldest_read if read >= limit else oldest_ours
        span = 1 if oldest is None else max(1, int(now) - int(oldest))
        return RecentRuns(int(count), int(duration), span)

    def task_classes(self) -> list[str]:
        """Task classes with rows in the active table."""
        with self.engine.connect() as conn:
            return list(conn.execute(sql.select_task_classes()).scalars())

    def extend_sent(self, ids: Sequence[int], owner: str, seconds: int) -> int:
        """Give rows whose messages were sent their dispatch lease (``seconds``)."""
        if not ids:
            return 0
        return self.transaction(
            lambda conn: conn.execute(sql.extend_sent_leases(ids, owner, seconds)).rowcount
        )

    def free_own(self, ids: Sequence[int], owner: str) -> int:
        """Hand back leases ``owner`` holds but never started; returns how many."""
        if not ids:
            return 0
        return self.transaction(lambda conn: conn.execute(sql.free_own_leases(ids, owner)).rowcount)

    # -- follow-ups: the rare per-task outcome that needs SQLAlchemy --------------------

    def _complete_with(
        self,
        lease: Lease,
        duration_us: int,
        followups: Sequence[NewTask],
        archived_as: str | None = None,
    ) -> bool:
        """Archive with result 0 (the archive row's owner ``archived_as``, else the
        lease's) and enqueue follow-ups, in one SQLAlchemy transaction."""
        # Checked before anything is written; the priority is the parent's, known later.
        for followup in followups:
            followup.validated()
        fence = {
            "task_id": lease.task_id,
            "owner": lease.owner,
            "failure_count": lease.failure_count,
        }
        archive_owner = archived_as or lease.owner

        def work(conn: Connection) -> bool:
            archived = conn.execute(
                sql.ARCHIVE,
                {
                    **fence,
                    "archive_owner": archive_owner,
                    "result": RESULT_SUCCESS,
                    "duration": duration_us,
                },
            )
            if archived.rowcount != 1:
                return False
            conn.execute(sql.DELETE_ARCHIVED_ACTIVE, fence)
            priority = conn.execute(sql.archived_priority(lease.task_id)).scalar_one()
            inherited = [f.with_default_priority(priority).validated() for f in followups]
            self._insert_tasks(conn, inherited)
            return True

        return self.transaction(work)

    # -- reads --------------------------------------------------------------------------

    def get(self, task_id: int) -> Task | None:
        """One task, active or archived."""
        found = self.list(TaskFilter(ids=[task_id]))
        return found[0] if found else None

    def list(self, selector: TaskFilter | None = None) -> list[Task]:
        """Tasks matching ``bin/worker``'s selectors, active first, newest first."""
        selector = selector or TaskFilter()
        tasks: list[Task] = []
        with self.engine.connect() as conn:
            if not selector.archived:
                query = sql.select_tasks(active_table, selector)
                tasks += [_task(row) for row in conn.execute(query)]
            if not selector.active:
                query = sql.select_tasks(archive_table, selector)
                tasks += [_task(row, archived=True) for row in conn.execute(query)]
        return tasks if selector.limit is None else tasks[: selector.limit]

    def ages(self, now: int, shares: Mapping[str, int] | None = None) -> Sequence[Any]:
        """Active rows per (class, state, whose) with their count, since when the first
        was due and when the first was leased (``statements.active_ages``; ``shares``:
        the bridge's weight of each class it shares with phd): the queue gauges."""
        with self.engine.connect() as conn:
            return list(conn.execute(sql.active_ages(now, shares)))

    def stats(self, archived_window: int = 3600) -> QueueStats:
        """Counts per class and state, archived counts of the last window, oldest queued age.

        Three queries: the clock, one grouped scan of the active table, and an index
        range scan of the archive's recent rows.
        """
        with self.engine.connect() as conn:
            now = int(conn.execute(sql.server_time()).scalar_one())
            stats = QueueStats(server_time=now, archived_window=archived_window)
            oldest: int | None = None
            for task_class, state, count, first in conn.execute(
                sql.count_active_by_class_and_state(now)
            ):
                stats.by_class.setdefault(task_class, {})[state] = count
                if state == "queued" and (oldest is None or first < oldest):
                    oldest = first
            for task_class, result, count in conn.execute(
                sql.count_archived_by_class_and_result(now - archived_window)
            ):
                name = {0: "succeeded", 1: "failed", 2: "cancelled"}.get(result, f"result-{result}")
                stats.by_class.setdefault(task_class, {})[f"archived-{name}"] = count
        stats.oldest_queued_age = None if oldest is None else max(0, now - oldest)
        return stats
