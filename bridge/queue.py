"""PhorgeQueue: Phorge's task queue, read and written exactly as Phorge's PHP does.

One class runs every statement of ``bridge.statements`` in the right transactions.
Outcome methods return whether this caller still owned the row: False means the
lease was lost and nothing was written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, Row, create_engine, event
from sqlalchemy.exc import DBAPIError

from bridge import statements as sql
from bridge.dialect import next_task_ids
from bridge.handlers.base import FollowUp
from bridge.model import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_RETRY_WAIT,
    MAX_UINT64,
    MIN_YIELD_SECONDS,
    PRIORITY_DEFAULT,
    RESULT_FAILURE,
    RESULT_SUCCESS,
    ActionResult,
    NewTask,
    QueueStats,
    Task,
    TaskFilter,
    check_owner,
    check_priority,
    check_seconds,
    decode_data,
    lease_epoch,
)
from bridge.schema import metadata
from bridge.schema import worker_activetask as active_table
from bridge.schema import worker_archivetask as archive_table

log = logging.getLogger(__name__)
T = TypeVar("T")

# InnoDB's "deadlock found" and "lock wait timeout": the transaction was rolled back
# whole, so running it again is safe (every write in it is guarded).
_RETRYABLE_MYSQL_ERRORS = {1213, 1205}


class LostLease(Exception):
    """Raised inside a transaction to roll it back when the fence no longer holds."""


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine configured for Phorge's tables on MariaDB/MySQL or SQLite."""
    if url.startswith("sqlite"):
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    connect_args = {
        "charset": "utf8mb4",
        # Phorge runs with STRICT_ALL_TABLES; a write it would refuse is refused here too.
        "init_command": "SET SESSION sql_mode = 'STRICT_ALL_TABLES'",
    }
    connect_args.update(kwargs.pop("connect_args", {}))
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_recycle", 3600)
    return create_engine(url, connect_args=connect_args, **kwargs)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL lets readers (the poller, the CLI) run beside one writer; busy_timeout makes
    # concurrent writers wait instead of failing at once. Transactions are begun by
    # ``_sqlite_begin`` instead of pysqlite, so a read-then-write cannot lose its snapshot.
    dbapi_connection.isolation_level = None
    dbapi_connection.create_function("owner_epoch", 1, lease_epoch, deterministic=True)
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_begin(conn: Connection) -> None:
    # Writers take the write lock up front (a deferred read-then-write could lose its
    # snapshot); readers take none and read the last committed state beside them.
    write = conn.get_execution_options().get("bridge_write")
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _task(row: Row, archived: bool = False) -> Task:
    fields = row._asdict()
    if "rawData" not in fields:
        return Task(**fields, archived=archived)
    data, error = decode_data(fields["rawData"])
    return Task(**fields, archived=archived, data=data, dataError=error)


class PhorgeQueue:
    """The worker queue of one Phorge install (one ``{namespace}_worker`` database)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._mysql = engine.dialect.name in ("mysql", "mariadb")

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> PhorgeQueue:
        return cls(make_engine(url, **kwargs))

    def create_tables(self) -> None:
        """Create Phorge's four tables if missing (tests and the embedded default only)."""
        metadata.create_all(self.engine)

    def _transaction(self, work: Callable[[Connection], T], attempts: int = 4) -> T:
        """Run ``work`` in one transaction, again after an InnoDB deadlock or lock timeout."""
        for attempt in range(1, attempts + 1):
            try:
                with self.engine.connect() as conn:
                    conn.execution_options(bridge_write=True)
                    with conn.begin():
                        return work(conn)
            except DBAPIError as exc:
                code = exc.orig.args[0] if exc.orig is not None and exc.orig.args else None
                if not self._mysql or code not in _RETRYABLE_MYSQL_ERRORS or attempt == attempts:
                    raise
                log.info("retrying after MySQL error %s (attempt %d)", code, attempt)
                time.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

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
    ) -> list[Task]:
        """Lease up to ``limit`` tasks in Phorge's two phases; returns only rows this call won.

        ``owner`` must be unique to this call (see ``model.new_owner``): the final read
        selects the rows it holds by owner, as PHP does.
        """
        check_owner(owner)
        check_seconds("lease seconds", seconds, minimum=1)
        if limit <= 0 or (classes is not None and not classes):
            return []
        won = 0
        for take_phase in (self._take_unleased, self._take_expired):
            won += self._transaction(
                lambda conn, take=take_phase, n=limit - won: take(
                    conn, n, owner, seconds, classes, exclude_classes
                )
            )
            if won >= limit:
                break
        if not won:
            return []
        with self.engine.connect() as conn:
            return [_task(row) for row in conn.execute(sql.select_held(owner)).all()]

    @staticmethod
    def _take_unleased(conn, limit, owner, seconds, classes, exclude_classes) -> int:
        rows = conn.execute(sql.select_unleased(limit, classes, exclude_classes)).all()
        ids = [row.id for row in rows]
        return conn.execute(sql.take_unleased(ids, owner, seconds)).rowcount if ids else 0

    @staticmethod
    def _take_expired(conn, limit, owner, seconds, classes, exclude_classes) -> int:
        rows = conn.execute(sql.select_expired(limit, classes, exclude_classes)).all()
        return conn.execute(sql.take_expired(rows, owner, seconds)).rowcount if rows else 0

    def held(self, task_id: int, owner: str, with_data: bool = True) -> Task | None:
        """The task if ``owner`` still holds its lease right now (a read, no write)."""
        with self.engine.connect() as conn:
            row = conn.execute(sql.select_held(owner, task_id, with_data)).first()
        return None if row is None else _task(row)

    def held_by_class(self, owner_prefix: str) -> dict[str, int]:
        """Live, running leases per task class of every owner starting with the prefix."""
        with self.engine.connect() as conn:
            rows = conn.execute(sql.count_held_by_class(owner_prefix)).all()
        return {task_class: count for task_class, count in rows}

    def task_classes(self) -> list[str]:
        """Task classes with rows in the active table."""
        with self.engine.connect() as conn:
            return list(conn.execute(sql.select_task_classes()).scalars())

    def renew(self, task_id: int, owner: str, seconds: int) -> bool:
        """Extend a held lease to now + ``seconds`` (claim, heartbeat)."""
        check_seconds("lease seconds", seconds, minimum=1)
        return self._guarded(sql.renew_lease(task_id, owner, seconds))

    def free_own(self, ids: Sequence[int], owner: str) -> int:
        """Hand back leases ``owner`` holds but never started; returns how many."""
        if not ids:
            return 0
        return self._transaction(
            lambda conn: conn.execute(sql.free_own_leases(ids, owner)).rowcount
        )

    # -- outcomes -----------------------------------------------------------------------

    def _guarded(self, statement) -> bool:
        return self._transaction(lambda conn: conn.execute(statement).rowcount == 1)

    def complete(
        self, task_id: int, owner: str, duration_us: int, followups: Sequence[FollowUp] = ()
    ) -> bool:
        """Archive with result 0, then enqueue the follow-ups, in one transaction."""
        check_seconds("duration", duration_us, maximum=MAX_UINT64)
        # Checked before anything is written; the priority is the parent's, known later.
        checked = [f.as_new_task(PRIORITY_DEFAULT).validated() for f in followups]

        def work(conn: Connection) -> bool:
            row = self._archive(conn, task_id, owner, RESULT_SUCCESS, duration_us)
            if row is None:
                return False
            # Follow-ups default to the parent's priority, as flushTaskQueue($defaults).
            inherited = [
                (f.as_new_task(row.priority), data_json)
                for f, (_, data_json) in zip(followups, checked, strict=True)
            ]
            self._insert_tasks(conn, inherited)
            return True

        return self._fenced(work)

    def fail_permanent(self, task_id: int, owner: str, reason: str = "") -> bool:
        """Archive with result 1 and duration 0; ``reason`` goes to the log (no column)."""
        won = self._fenced(
            lambda conn: self._archive(conn, task_id, owner, RESULT_FAILURE, 0) is not None
        )
        if won:
            log.warning("task %d failed permanently: %s", task_id, reason)
        return won

    def _fenced(self, work: Callable[[Connection], bool]) -> bool:
        try:
            return self._transaction(work)
        except LostLease:
            return False

    def _archive(self, conn: Connection, task_id: int, owner: str, result: int, duration: int):
        row = conn.execute(sql.lock_held(task_id, owner)).first()
        if row is None:
            return None
        conn.execute(sql.insert_archive(row, result, duration))
        if conn.execute(sql.delete_held(task_id, owner)).rowcount != 1:
            raise LostLease(task_id)
        return row

    def fail_temporary(self, task_id: int, owner: str, wait: int = DEFAULT_RETRY_WAIT) -> bool:
        """Count a failure and hold the task back ``wait`` seconds; the owner stays."""
        check_seconds("retry wait", wait)
        return self._guarded(sql.fail_temporary(task_id, owner, wait))

    def yield_(self, task_id: int, owner: str, seconds: int) -> bool:
        """Give the task back for at least 5 seconds without counting a failure."""
        check_seconds("yield seconds", seconds)
        return self._guarded(sql.yield_lease(task_id, owner, max(seconds, MIN_YIELD_SECONDS)))

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
