"""LeaseSession: the per-task path (check, renew, outcome) on one long-lived connection.

A worker runs this path for every task, so it is built to cost as little as possible:
statements compiled once per dialect and sent through the driver with positional
parameters; one connection held for the process (no pool checkout, ping or rollback per
task); the check before a run is one read; an outcome is one transaction sent in one
round trip on MariaDB/MySQL (``START TRANSACTION; ...; COMMIT`` as one multi-statement
query). Every write is fenced by ``model.Lease``; ``False`` means the fence no longer
held and nothing was written. Transient errors drop the connection (the server rolls
back whatever was open) and are retried by ``retry.retrying``.

Not thread-safe: one session per thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Engine
from sqlalchemy.sql import ClauseElement

from bridge.queue import statements as sql
from bridge.queue.dialect import is_mysql
from bridge.queue.model import (
    MAX_UINT32,
    MAX_UINT64,
    MIN_YIELD_SECONDS,
    RESULT_FAILURE,
    RESULT_SUCCESS,
    Lease,
    NewTask,
    Task,
    check_seconds,
    task_from_row,
)
from bridge.queue.retry import is_transient, retrying

log = logging.getLogger(__name__)


class Compiled(NamedTuple):
    """A statement rendered for one dialect: its SQL and how to order its parameters."""

    sql: str
    names: tuple[str, ...]
    defaults: dict[str, Any]

    def params(self, values: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(values[n] if n in values else self.defaults[n] for n in self.names)


class LeaseSession:
    """The fenced per-task statements of one process (or thread)."""

    def __init__(
        self, engine: Engine, followup_writer: Callable[..., bool], attempts: int = 5
    ) -> None:
        self.engine = engine
        self.attempts = attempts
        self._mysql = is_mysql(engine)
        self._compiled: dict[int, Compiled] = {}
        self._connection: Any = None
        # Follow-ups need ids from lisk_counter and data rows first: a rare path that
        # runs the same archive statements through SQLAlchemy (PhorgeQueue).
        self._write_followups = followup_writer

    # -- connection -------------------------------------------------------------------

    def _dbapi(self) -> Any:
        if self._connection is None:
            self._connection = self.engine.raw_connection()
            if self._mysql:
                self._connection.dbapi_connection.autocommit(True)
        return self._connection

    def close(self) -> None:
        """Give the connection back (it is closed if it may be mid-transaction)."""
        if self._connection is not None:
            connection, self._connection = self._connection, None
            connection.close()

    def _drop(self) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            connection.invalidate()

    def _compile(self, statement: ClauseElement) -> Compiled:
        key = id(statement)
        if key not in self._compiled:
            compiled = statement.compile(dialect=self.engine.dialect)
            self._compiled[key] = Compiled(
                compiled.string, tuple(compiled.positiontup or ()), dict(compiled.params)
            )
        return self._compiled[key]

    def _run(self, what: str, work: Callable[[Any], Any]) -> Any:
        """``work(cursor)`` with the retry policy; a failed attempt drops the connection."""

        def attempt() -> Any:
            cursor = self._dbapi().cursor()
            try:
                return work(cursor)
            except Exception as exc:
                if is_transient(exc) or not self._mysql:
                    self._drop()
                else:
                    self._rollback()
                raise
            finally:
                cursor.close()

        return retrying(what, attempt, self.attempts)

    def _rollback(self) -> None:
        try:
            self._dbapi().rollback()
        except Exception:
            self._drop()

    def _transaction(self, steps: Sequence[tuple[ClauseElement, dict[str, Any]]]):
        """Run ``steps`` in one transaction; returns each one's row count."""

        def work(cursor) -> list[int]:
            compiled = [(self._compile(statement), values) for statement, values in steps]
            if not self._mysql:
                cursor.execute("BEGIN IMMEDIATE")
                counts = []
                for c, values in compiled:
                    cursor.execute(c.sql, c.params(values))
                    counts.append(cursor.rowcount)
                cursor.execute("COMMIT")
                return counts
            script = ";".join(["START TRANSACTION", *(c.sql for c, _ in compiled), "COMMIT"])
            params = tuple(p for c, values in compiled for p in c.params(values))
            cursor.execute(script, params)
            counts = []
            while cursor.nextset():
                counts.append(cursor.rowcount)
            return counts[: len(steps)]

        return self._run("transaction", work)

    def _write(self, statement: ClauseElement, values: dict[str, Any]) -> bool:
        """One guarded statement in its own (autocommitted) transaction: did it hold?"""
        return self._transaction([(statement, values)])[0] == 1

    # -- the per-task path ------------------------------------------------------------

    def held(self, lease: Lease, with_data: bool = True) -> Task | None:
        """The task if ``lease`` still holds right now (a read, no write)."""
        statement = sql.HELD_WITH_DATA if with_data else sql.HELD
        compiled = self._compile(statement)

        def work(cursor) -> Task | None:
            cursor.execute(compiled.sql, compiled.params(_fence(lease)))
            row = cursor.fetchone()
            if row is None:
                return None
            names = [column[0] for column in cursor.description]
            return task_from_row(dict(zip(names, row, strict=True)))

        result = self._run(f"task {lease.task_id}", work)
        if not self._mysql:
            self._dbapi().rollback()  # end SQLite's implicit read
        return result

    def renew(self, lease: Lease, seconds: int) -> bool:
        """Extend a held lease to now + ``seconds`` (claim, heartbeat)."""
        check_seconds("lease seconds", seconds, minimum=1)
        return self._write(sql.RENEW_LEASE, {**_fence(lease), "seconds": seconds})

    def complete(self, lease: Lease, duration_us: int, followups: Sequence[NewTask] = ()) -> bool:
        """Archive with result 0, with the follow-ups in the same transaction."""
        check_seconds("duration", duration_us, maximum=MAX_UINT64)
        if followups:
            return self._write_followups(lease, duration_us, followups)
        return self._archive(lease, RESULT_SUCCESS, duration_us)

    def fail_permanent(self, lease: Lease) -> bool:
        """Archive with result 1 and duration 0."""
        return self._archive(lease, RESULT_FAILURE, 0)

    def _archive(self, lease: Lease, result: int, duration_us: int) -> bool:
        fence = _fence(lease)
        inserted, deleted = self._transaction(
            [
                (sql.ARCHIVE, {**fence, "result": result, "duration": duration_us}),
                (sql.DELETE_ARCHIVED_ACTIVE, fence),
            ]
        )
        if inserted != deleted:  # the row lock makes this impossible; say so if it is not
            log.error("task %d: archived %d, removed %d", lease.task_id, inserted, deleted)
        return inserted == 1

    def fail_temporary(self, lease: Lease, wait: int) -> bool:
        """Count a failure and hold the task back ``wait`` seconds; the owner stays.

        A negative wait is Phorge's too (its tests use -60): the lease then expired
        ``-wait`` seconds ago, so the task is due at once, behind older expiries."""
        check_seconds("retry wait", wait, minimum=-MAX_UINT32)
        return self._write(sql.FAIL_TEMPORARY, {**_fence(lease), "wait": wait})

    def yield_(self, lease: Lease, seconds: int) -> bool:
        """Give the task back for at least 5 seconds without counting a failure
        (shorter yields, negative ones included, last 5 seconds, as in Phorge)."""
        check_seconds("yield seconds", seconds, minimum=-MAX_UINT32)
        seconds = max(seconds, MIN_YIELD_SECONDS)
        return self._write(sql.YIELD_LEASE, {**_fence(lease), "seconds": seconds})


def _fence(lease: Lease) -> dict[str, Any]:
    return {"task_id": lease.task_id, "owner": lease.owner, "failure_count": lease.failure_count}
