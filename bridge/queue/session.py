"""LeaseSession: the per-task path (check, renew, outcome) on one long-lived connection.

A worker runs this path for every task, so it is built to cost as little as possible:
statements compiled once per dialect and sent through the driver with positional
parameters; one connection held for the process (no pool checkout, ping or rollback per
task); the check before a run is one read; an outcome is one transaction sent in one
round trip on MariaDB/MySQL (``START TRANSACTION; ...; COMMIT`` as one multi-statement
query), and in a batch it shares that round trip with the next task's check. Every
write is fenced by ``model.Lease``; ``False`` means the fence no longer held and nothing
was written. Transient errors drop the connection (the server rolls back whatever was
open) and are retried by ``retry.retrying``.

Not thread-safe: one session per thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Engine
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

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
from bridge.queue.retry import fate_unknown, is_transient, retrying

log = logging.getLogger(__name__)


class Compiled(NamedTuple):
    """A statement rendered for one dialect: its SQL and how to order its parameters."""

    sql: str
    names: tuple[str, ...]
    defaults: dict[str, Any]

    def params(self, values: dict[str, Any]) -> list[Any]:
        return [values[n] if n in values else self.defaults[n] for n in self.names]


class Write(NamedTuple):
    """One task's guarded outcome (or renewal): its statements, and whether the row
    counts they return mean its fence held."""

    steps: list[tuple[ClauseElement, dict[str, Any]]]
    archive: bool = False
    # The read that finds the row as this write leaves it: asked when a connection was
    # lost with the COMMIT in flight and the retry found the fence gone.
    confirm: tuple[ClauseElement, dict[str, Any]] | None = None

    @classmethod
    def guarded(
        cls, statement: ClauseElement, values: dict[str, Any], confirm: ClauseElement | None = None
    ) -> Write:
        """One guarded UPDATE: held when it changed the row."""
        return cls([(statement, values)], confirm=None if confirm is None else (confirm, values))

    @classmethod
    def archiving(
        cls, lease: Lease, result: int, duration_us: int, archived_as: str | None = None
    ) -> Write:
        """The archive insert (locking the active row) and the active row's delete; the
        archive row's owner is ``archived_as`` (the lease's owner labelled with the
        implementation that ran it), else the lease's."""
        fence = {**_fence(lease), "archive_owner": archived_as or lease.owner}
        return cls(
            [
                (sql.ARCHIVE, {**fence, "result": result, "duration": duration_us}),
                (sql.DELETE_ARCHIVED_ACTIVE, fence),
            ],
            archive=True,
            confirm=(sql.ARCHIVED_BY, {**fence, "result": result}),
        )

    def fence_held(self, counts: Sequence[int]) -> bool:
        if not self.archive:
            return counts[0] == 1
        inserted, deleted = counts
        if inserted != deleted:  # the row lock makes this impossible; say so if it is not
            log.error("task %s: archived %d, removed %d", self.steps[0][1]["task_id"], *counts)
        return inserted == 1


class LeaseSession:
    """The fenced per-task statements of one process (or thread)."""

    def __init__(
        self, engine: Engine, followup_writer: Callable[..., bool], attempts: int = 5
    ) -> None:
        self.engine = engine
        self.attempts = attempts
        self._mysql = is_mysql(engine)
        self._compiled: dict[int, Compiled] = {}
        self._queries: dict[tuple[tuple[str, ...], str | None], str] = {}  # by shape
        self._connection: Any = None
        self._lost_in_flight = False  # the last _run lost a connection mid-statement
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
            assert isinstance(compiled, SQLCompiler)  # DML, SELECT and text, never DDL
            self._compiled[key] = Compiled(
                compiled.string, tuple(compiled.positiontup or ()), dict(compiled.params)
            )
        return self._compiled[key]

    def _run(self, what: str, work: Callable[[Any], Any]) -> Any:
        """``work(cursor)`` with the retry policy; a failed attempt drops the connection."""

        self._lost_in_flight = False

        def attempt() -> Any:
            cursor = self._dbapi().cursor()
            try:
                return work(cursor)
            except Exception as exc:
                self._lost_in_flight |= fate_unknown(exc)
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

    def _script(
        self,
        what: str,
        steps: Sequence[tuple[ClauseElement, dict[str, Any]]],
        read: tuple[ClauseElement, dict[str, Any]] | None = None,
        data_json: str | None = None,
    ) -> tuple[list[int], Task | None]:
        """``steps`` in one transaction, then ``read`` (one row, after the commit), in one
        round trip on MariaDB; returns each step's row count and the row read (with
        ``data_json`` as its data, when given)."""

        def work(cursor: Any) -> tuple[list[int], Task | None]:
            compiled = [(self._compile(statement), values) for statement, values in steps]
            query = (self._compile(read[0]), read[1]) if read is not None else None
            if not self._mysql:
                counts = []
                if compiled:
                    cursor.execute("BEGIN IMMEDIATE")
                    for c, values in compiled:
                        cursor.execute(c.sql, c.params(values))
                        counts.append(cursor.rowcount)
                    cursor.execute("COMMIT")
                if query is None:
                    return counts, None
                cursor.execute(query[0].sql, query[0].params(query[1]))
                return counts, _task(cursor.fetchone(), cursor.description, data_json)
            steps_sql = tuple(c.sql for c, _ in compiled)
            if query is not None:
                compiled.append(query)
            sql_text = self._query(steps_sql, query[0].sql if query is not None else None)
            cursor.execute(sql_text, _params(compiled))
            if not steps:
                return [], _task(cursor.fetchone(), cursor.description, data_json)
            # The results after START TRANSACTION's, read on the driver's connection: the
            # cursor would describe and fetch every one, and they are row counts but one.
            db = cursor.connection
            counts = []
            for _ in steps:
                db.next_result()
                counts.append(db.affected_rows())
            db.next_result()  # COMMIT
            if query is None:
                return counts, None
            db.next_result()
            result = db.store_result()
            rows = result.fetch_row()
            return counts, _task(rows[0] if rows else None, result.describe(), data_json)

        result: tuple[list[int], Task | None] = self._run(what, work)
        if read is not None and not self._mysql:
            self._dbapi().rollback()  # end SQLite's implicit read
        return result

    def _query(self, steps: tuple[str, ...], read: str | None) -> str:
        """The multi-statement SQL of one round trip: ``steps`` in a transaction, then
        ``read``; joined once per shape."""
        query = self._queries.get((steps, read))
        if query is None:
            parts = ["START TRANSACTION", *steps, "COMMIT"] if steps else []
            if read is not None:
                parts.append(read)
            query = self._queries[(steps, read)] = ";".join(parts)
        return query

    def apply(self, writes: Sequence[Write]) -> list[bool]:
        """Write ``writes`` in one transaction (one round trip, one commit); returns
        whether each one's fence held. A lost fence writes nothing for its task alone."""
        counts, _ = self._script("outcome", [step for write in writes for step in write.steps])
        return self._verdicts(writes, counts)

    def _verdicts(self, writes: Sequence[Write], counts: Sequence[int]) -> list[bool]:
        """Each write's verdict. When a connection was lost with the COMMIT in flight, a
        fence the retry found gone may be this very write's doing: the row tells."""
        held = _fences_held(writes, counts)
        if self._lost_in_flight:
            held = [h or self.written(w) for h, w in zip(held, writes, strict=True)]
        return held

    def written(self, write: Write) -> bool:
        """Whether the row is as ``write`` leaves it, under the same lease (a read)."""
        if write.confirm is None or write.confirm[1].get("failure_count") is None:
            return False
        statement, values = write.confirm
        compiled = self._compile(statement)

        def work(cursor: Any) -> bool:
            cursor.execute(compiled.sql, compiled.params(values))
            return cursor.fetchone() is not None

        found = bool(self._run(f"task {values['task_id']}: was its outcome written", work))
        if not self._mysql:
            self._dbapi().rollback()  # end SQLite's implicit read
        if found:
            log.warning(
                "task %s: its outcome was written before the connection was lost", values["task_id"]
            )
        return found

    # -- the per-task path ------------------------------------------------------------

    def check(self, lease: Lease, data_json: str | None = None) -> Task | None:
        """The task if ``lease`` still holds right now (a read, no write); its data is
        ``data_json`` (as its message carried it), else read with the row."""
        return self.write_then_check((), lease, data_json)[1]

    def write_then_check(
        self, writes: Sequence[Write], lease: Lease, data_json: str | None = None
    ) -> tuple[list[bool], Task | None]:
        """Write the outcomes of the tasks run before (committed first), then check the
        next task's lease, in one round trip: a batch's tasks cost one round trip each."""
        statement = sql.HELD if data_json is not None else sql.HELD_WITH_DATA
        counts, task = self._script(
            f"task {lease.task_id}",
            [step for write in writes for step in write.steps],
            (statement, _fence(lease)),
            data_json,
        )
        return self._verdicts(writes, counts), task

    def renew(self, lease: Lease, seconds: int) -> bool:
        """Extend a held lease to now + ``seconds`` (claim, heartbeat)."""
        check_seconds("lease seconds", seconds, minimum=1)
        renewal = Write.guarded(sql.RENEW_LEASE, {**_fence(lease), "seconds": seconds})
        return self.apply([renewal])[0]

    def complete(
        self,
        lease: Lease,
        duration_us: int,
        followups: Sequence[NewTask] = (),
        archived_as: str | None = None,
    ) -> bool:
        """Archive with result 0 (the archive row's owner ``archived_as``, see
        :func:`success`), with the follow-ups in the same transaction."""
        if followups:
            check_seconds("duration", duration_us, maximum=MAX_UINT64)
            # A fence found gone may be this very write's, its COMMIT lost with its
            # connection: the row tells (a read on the rare lost-lease path only).
            return self._write_followups(
                lease, duration_us, followups, archived_as=archived_as
            ) or self.written(success(lease, duration_us, archived_as))
        return self.apply([success(lease, duration_us, archived_as)])[0]


# -- outcomes, as writes that LeaseSession.apply sends alone or together --------------


def success(lease: Lease, duration_us: int, archived_as: str | None = None) -> Write:
    """Archive with result 0 (a success without follow-ups); the archive row's owner is
    ``archived_as`` when given (the owner labelled with who ran it), else the lease's."""
    check_seconds("duration", duration_us, maximum=MAX_UINT64)
    return Write.archiving(lease, RESULT_SUCCESS, duration_us, archived_as)


def permanent_failure(lease: Lease, archived_as: str | None = None) -> Write:
    """Archive with result 1 and duration 0 (``archived_as``: see :func:`success`)."""
    return Write.archiving(lease, RESULT_FAILURE, 0, archived_as)


def temporary_failure(lease: Lease, wait: int, failed_as: str | None = None) -> Write:
    """Count a failure and hold the task back ``wait`` seconds; the owner stays, labelled
    ``failed_as`` when given (as :func:`success`'s ``archived_as``).

    A negative wait is Phorge's too (its tests use -60): the lease then expired
    ``-wait`` seconds ago, so the task is due at once, behind older expiries."""
    check_seconds("retry wait", wait, minimum=-MAX_UINT32)
    values = {**_fence(lease), "wait": wait, "failed_owner": failed_as or lease.owner}
    return Write.guarded(sql.FAIL_TEMPORARY, values, sql.FAILED_BY)


def yielded(lease: Lease, seconds: int) -> Write:
    """Give the task back for at least 5 seconds without counting a failure
    (shorter yields, negative ones included, last 5 seconds, as in Phorge)."""
    check_seconds("yield seconds", seconds, minimum=-MAX_UINT32)
    seconds = max(seconds, MIN_YIELD_SECONDS)
    return Write.guarded(sql.YIELD_LEASE, {**_fence(lease), "seconds": seconds}, sql.YIELDED_FROM)


def handed_back(lease: Lease) -> Write:
    """Give the lease back at once, no failure counted: the task did not run here (its
    transport is down in this worker) and is due for another worker now."""
    return Write.guarded(sql.HAND_BACK, _fence(lease), sql.HANDED_BACK_FROM)


def fell_back(lease: Lease) -> Write:
    """A canary's fallback: the new side failed this run, so the row goes to the
    old side, due at once (owner and expiry NULL, ``failureTime`` now), its failure count
    unchanged (``statements.FALL_BACK``)."""
    return Write.guarded(sql.FALL_BACK, _fence(lease), sql.FELL_BACK_FROM)


def _fences_held(writes: Sequence[Write], counts: Sequence[int]) -> list[bool]:
    """Each write's verdict, from the row counts of all their statements in order."""
    held, at = [], 0
    for write in writes:
        held.append(write.fence_held(counts[at : at + len(write.steps)]))
        at += len(write.steps)
    return held


def _params(compiled: list[tuple[Compiled, dict[str, Any]]]) -> list[Any]:
    return [p for c, values in compiled for p in c.params(values)]


def _task(
    row: tuple[Any, ...] | None, description: Sequence[tuple[Any, ...]], data_json: str | None
) -> Task | None:
    """The Task of a row read with its ``description`` (the DB-API's)."""
    if row is None:
        return None
    fields = dict(zip([column[0] for column in description], row, strict=True))
    if data_json is not None:
        fields["raw_data"] = data_json
    return task_from_row(fields)


def _fence(lease: Lease) -> dict[str, Any]:
    return {"task_id": lease.task_id, "owner": lease.owner, "failure_count": lease.failure_count}
