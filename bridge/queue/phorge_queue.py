"""PhorgeQueue: Phorge's task queue, read and written exactly as Phorge's PHP does.

It runs every statement of ``bridge.queue.statements`` in the right transactions:
enqueue, lease, the per-task outcomes (through ``LeaseSession``), ``bin/worker``'s
operator actions and the reads. Outcome methods return whether the caller still held the
lease: False means the fence no longer held and nothing was written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, Row

from bridge.queue import statements as sql
from bridge.queue.dialect import is_mysql, make_engine, next_task_ids
from bridge.queue.model import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_RETRY_WAIT,
    PRIORITY_DEFAULT,
    RESULT_SUCCESS,
    ActionResult,
    Lease,
    Leased,
    NewTask,
    QueueStats,
    Task,
    TaskFilter,
    check_owner,
    check_priority,
    check_seconds,
    task_from_row,
)
from bridge.queue.retry import retrying
from bridge.queue.schema import metadata
from bridge.queue.schema import worker_activetask as active_table
from bridge.queue.schema import worker_archivetask as archive_table
from bridge.queue.session import LeaseSession

log = logging.getLogger(__name__)
T = TypeVar("T")


def _task(row: Row, archived: bool = False) -> Task:
    return task_from_row(row._asdict(), archived)


def _utf8(raw: bytes | None) -> str | None:
    """Data to send inline; None (read and judged by the worker) when not UTF-8."""
    try:
        return raw.decode("utf-8") if raw is not None else None
    except UnicodeDecodeError:
        return None


class PhorgeQueue:
    """The worker queue of one Phorge install (one ``{namespace}_worker`` database)."""

    def __init__(self, engine: Engine, attempts: int = 5) -> None:
        self.engine = engine
        self.attempts = attempts  # tries of a transaction through transient errors
        self._sessions = threading.local()

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

    def _transaction(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in one transaction, again after a transient error (``retry``)."""

        def attempt() -> T:
            with self.engine.connect() as conn:
                conn.execution_options(bridge_write=True)
                with conn.begin():
                    return work(conn)

        return retrying("transaction", attempt, self.attempts)

    @contextmanager
    def poll_lock(self, name: str) -> Iterator[int | None]:
        """Hold the poll lock ``name`` for the block; yields the database time, or None
        when another poll holds it (MySQL's ``GET_LOCK``, per server, so per database
        name too). SQLite, the single-process embedded default, has no such lock.
        """
        with self.engine.connect() as conn:
            if not is_mysql(self.engine):
                yield int(conn.execute(sql.server_time()).scalar_one())
                return
            key = f"phorge-bridge:{self.engine.url.database}:{name}"[:64]
            got, now = conn.execute(sql.get_lock(key)).one()
            if not got:
                yield None
                return
            try:
                yield int(now)
            finally:
                conn.execute(sql.release_lock(key))

    def server_time(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sql.server_time()).scalar_one())

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
        return self._transaction(lambda conn: self._insert_tasks(conn, checked))

    def _insert_tasks(self, conn: Connection, checked: list[tuple[NewTask, str]]) -> list[int]:
        # The counter is taken inside this transaction: its row stays locked until commit,
        # which keeps ids and rows atomic at the cost of serialising concurrent enqueuers.
        ids = next_task_ids(conn, len(checked))
        for task_id, (task, data_json) in zip(ids, checked, strict=True):
            data_id = conn.execute(sql.insert_data(data_json)).inserted_primary_key[0]
            conn.execute(sql.insert_active(task_id, data_id, task))
        return ids

    # -- lease --------------------------------------------------------------------------

    def lease(
        self,
        limit: int,
        owner: str,
        seconds: int = DEFAULT_LEASE_SECONDS,
        *,
        classes: Sequence[str] | None = None,
        exclude_classes: Sequence[str] | None = None,
        ids: Sequence[int] | None = None,
        expired_first: bool = False,
    ) -> list[Task]:
        """Lease up to ``limit`` tasks in Phorge's two phases; returns only rows this call won.

        ``owner`` must be unique to this call (see ``model.new_owner``): the final read
        selects the rows it holds by owner, as PHP does. ``ids`` restricts both phases
        to those tasks (``PhabricatorWorkerLeaseQuery::withIDs``). ``expired_first``
        runs the expired phase first, so lost dispatches come back before the backlog.
        """
        where = sql.LeaseFilter(classes, exclude_classes, ids)
        if not self._take(limit, owner, seconds, where, expired_first):
            return []
        with self.engine.connect() as conn:
            return [_task(row) for row in conn.execute(sql.select_leased(owner)).all()]

    def lease_to_send(
        self, limit: int, owner: str, seconds: int, classes: Sequence[str], inline_max: int
    ) -> list[Leased]:
        """The poll's lease: as :meth:`lease` with ``expired_first``, returning the rows as
        their messages carry them, data undecoded and only up to ``inline_max`` bytes
        (the worker decodes it, or reads a larger one, when it checks the lease)."""
        if not self._take(limit, owner, seconds, sql.LeaseFilter(classes), expired_first=True):
            return []
        with self.engine.connect() as conn:
            rows = conn.execute(sql.select_leased_to_send(owner, inline_max)).all()
        return [Leased(r.id, r.failureCount, r.taskClass, _utf8(r.rawData)) for r in rows]

    def _take(
        self, limit: int, owner: str, seconds: int, where: sql.LeaseFilter, expired_first: bool
    ) -> int:
        """Phorge's two lease phases, each its own transaction; returns the rows won."""
        check_owner(owner)
        check_seconds("lease seconds", seconds, minimum=1)
        if limit <= 0 or any(s is not None and not s for s in (where.classes, where.ids)):
            return 0
        phases = [self._take_unleased, self._take_expired]
        won = 0
        for take_phase in reversed(phases) if expired_first else phases:
            won += self._transaction(
                lambda conn, take=take_phase, n=limit - won: take(conn, n, owner, seconds, where)
            )
            if won >= limit:
                break
        return won

    @staticmethod
    def _take_unleased(conn, limit, owner, seconds, where) -> int:
        rows = conn.execute(sql.select_unleased(limit, where)).all()
        ids = [row.id for row in rows]
        return conn.execute(sql.take_unleased(ids, owner, seconds)).rowcount if ids else 0

    @staticmethod
    def _take_expired(conn, limit, owner, seconds, where) -> int:
        rows = conn.execute(sql.select_expired(limit, where)).all()
        return conn.execute(sql.take_expired(rows, owner, seconds)).rowcount if rows else 0

    def held(self, task_id: int, owner: str, *, failure_count: int | None = None) -> Task | None:
        """The task if ``owner`` still holds its lease right now (a read, no write)."""
        return self.session.held(Lease(task_id, owner, failure_count))

    def held_by_class(self, owner_prefix: str) -> dict[str, int]:
        """Live, running leases per task class of every owner starting with the prefix."""
        with self.engine.connect() as conn:
            rows = conn.execute(sql.count_held_by_class(owner_prefix)).all()
        return {task_class: count for task_class, count in rows}

    def task_classes(self) -> list[str]:
        """Task classes with rows in the active table."""
        with self.engine.connect() as conn:
            return list(conn.execute(sql.select_task_classes()).scalars())

    def free_own(self, ids: Sequence[int], owner: str) -> int:
        """Hand back leases ``owner`` holds but never started; returns how many."""
        if not ids:
            return 0
        return self._transaction(
            lambda conn: conn.execute(sql.free_own_leases(ids, owner)).rowcount
        )

    # -- outcomes (fenced: see LeaseSession) ----------------------------------------------
    #
    # ``failure_count`` None leaves the failure count out of the fence, as PHP's own
    # checks do; the executor always passes the count it was dispatched with.

    def renew(
        self, task_id: int, owner: str, seconds: int, *, failure_count: int | None = None
    ) -> bool:
        """Extend a held lease to now + ``seconds``."""
        return self.session.renew(Lease(task_id, owner, failure_count), seconds)

    def complete(
        self,
        task_id: int,
        owner: str,
        duration_us: int,
        followups: Sequence[NewTask] = (),
        *,
        failure_count: int | None = None,
    ) -> bool:
        """Archive with result 0, then enqueue the follow-ups, in one transaction."""
        return self.session.complete(Lease(task_id, owner, failure_count), duration_us, followups)

    def fail_permanent(
        self, task_id: int, owner: str, reason: str = "", *, failure_count: int | None = None
    ) -> bool:
        """Archive with result 1 and duration 0; ``reason`` goes to the log (no column)."""
        won = self.session.fail_permanent(Lease(task_id, owner, failure_count))
        if won:
            log.warning("task %d failed permanently: %s", task_id, reason)
        return won

    def fail_temporary(
        self,
        task_id: int,
        owner: str,
        wait: int = DEFAULT_RETRY_WAIT,
        *,
        failure_count: int | None = None,
    ) -> bool:
        """Count a failure and hold the task back ``wait`` seconds; the owner stays."""
        return self.session.fail_temporary(Lease(task_id, owner, failure_count), wait)

    def yield_(
        self, task_id: int, owner: str, seconds: int, *, failure_count: int | None = None
    ) -> bool:
        """Give the task back for at least 5 seconds without counting a failure."""
        return self.session.yield_(Lease(task_id, owner, failure_count), seconds)

    def _complete_with(self, lease: Lease, duration_us: int, followups: Sequence[NewTask]) -> bool:
        """Archive with result 0 and enqueue follow-ups, in one SQLAlchemy transaction."""
        # Checked before anything is written; the priority is the parent's, known later.
        for followup in followups:
            followup.validated()
        fence = {
            "task_id": lease.task_id,
            "owner": lease.owner,
            "failure_count": lease.failure_count,
        }

        def work(conn: Connection) -> bool:
            archived = conn.execute(
                sql.ARCHIVE, {**fence, "result": RESULT_SUCCESS, "duration": duration_us}
            )
            if archived.rowcount != 1:
                return False
            conn.execute(sql.DELETE_ARCHIVED_ACTIVE, fence)
            priority = conn.execute(sql.archived_priority(lease.task_id)).scalar_one()
            inherited = [f.with_default_priority(priority).validated() for f in followups]
            self._insert_tasks(conn, inherited)
            return True

        return self._transaction(work)

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

    def stats(self, archived_window: int = 3600) -> QueueStats:
        """Counts per class and state, archived counts of the last window, oldest queued age.

        Three queries: the clock, one grouped scan of the active table, and an index
        range scan of the archive's recent rows.
        """
        with self.engine.connect() as conn:
            now = int(conn.execute(sql.server_time()).scalar_one())
            stats = QueueStats(serverTime=now, archived_window=archived_window)
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

    # -- operator actions (bin/worker) ----------------------------------------------------

    def _act(
        self,
        selector: TaskFilter,
        act: Callable[[Connection, Task], str],
    ) -> list[ActionResult]:
        if not selector.constrained:
            raise ValueError("select the tasks to act on (ids, classes, ...): refusing all tasks")
        results = []
        for task in self.list(selector):
            reason = self._transaction(lambda conn, task=task: act(conn, task))
            results.append(ActionResult(task.id, task.label, not reason, reason))
        return results

    def cancel(self, selector: TaskFilter) -> list[ActionResult]:
        """Archive active tasks as cancelled (result 2), breaking any lease."""

        def act(conn: Connection, task: Task) -> str:
            if task.archived:
                return "ARCHIVED: already archived, and can not be cancelled"
            row = conn.execute(sql.lock_active(task.id)).first()
            if row is None:
                return "ARCHIVED: archived meanwhile"
            conn.execute(sql.cancel_archive(row))
            conn.execute(sql.delete_active(task.id))
            return ""

        return self._act(selector, act)

    def free(self, selector: TaskFilter) -> list[ActionResult]:
        """Break the leases of leased active tasks (owner NULL, expires now)."""

        def act(conn: Connection, task: Task) -> str:
            if task.archived:
                return "ARCHIVED: archived tasks do not have leases"
            if conn.execute(sql.free_lease(task.id)).rowcount != 1:
                return "FREE: has no active lease"
            return ""

        return self._act(selector, act)

    def delay(self, selector: TaskFilter, until: int) -> list[ActionResult]:
        """Hold unleased active tasks back until the epoch ``until``."""
        check_seconds("until", until)

        def act(conn: Connection, task: Task) -> str:
            if task.archived:
                return "ARCHIVED: already archived, and can not be delayed"
            if conn.execute(sql.delay_until(task.id, until)).rowcount != 1:
                return "LEASED: already leased, and can not be delayed"
            return ""

        return self._act(selector, act)

    def set_priority(self, selector: TaskFilter, priority: int) -> list[ActionResult]:
        """Reprioritize active tasks (a positive integer; smaller runs first)."""
        check_priority(priority)

        def act(conn: Connection, task: Task) -> str:
            if task.archived:
                return "ARCHIVED: already archived, and can not be reprioritized"
            if conn.execute(sql.set_priority(task.id, priority)).rowcount != 1:
                return f"UNCHANGED: already has priority {priority}"
            return ""

        return self._act(selector, act)

    def retry(self, selector: TaskFilter, repeat: bool = False) -> list[ActionResult]:
        """Re-queue archived tasks under their own id; succeeded ones only with ``repeat``."""

        def act(conn: Connection, task: Task) -> str:
            if not task.archived:
                return "ACTIVE: already in the active task queue"
            row = conn.execute(sql.lock_archived(task.id)).first()
            if row is None:
                return "ACTIVE: re-queued meanwhile"
            if row.result == RESULT_SUCCESS and not repeat:
                return "SUCCEEDED: already succeeded; use repeat to run it again"
            conn.execute(sql.reinsert_active(row))
            conn.execute(sql.delete_archived(task.id))
            return ""

        return self._act(selector, act)

    def awaken(self, ids: Sequence[int]) -> int:
        """Bring yielded, never-failed tasks forward (``awakenTaskIDs``); returns how many."""
        if not ids:
            return 0
        return self._transaction(lambda conn: conn.execute(sql.awaken(ids)).rowcount)
