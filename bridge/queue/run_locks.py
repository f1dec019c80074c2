"""Run locks: which tasks a live process is running now, as the database sees it.

A message redelivered by the broker (its worker died, or only its broker connection
did) carries a lease whose run may be dead or still going; the broker cannot tell the
two apart, and a second run of a live one would repeat its side effects. So every
process holds MySQL's named lock of each task it runs (:func:`run_lock_key`), on a
connection of its own, from before the lease's check until its outcome is written. The
lock is the task's, not its lease's: ``bin/phd restart`` (and ``phd start`` without
``--keep-leases``) frees every lease, the bridge's running ones included, and the row
leased again must not run beside the run that still lives; that run's outcome then
finds its lease gone, and the row runs again once its new lease expires, as Phorge's
own semantics have it. The
server frees a process's locks when its connection ends: at once when the process dies
(a prefork child, a whole worker, OOM or ``kill -9``), and :data:`IDLE_TIMEOUT`
seconds after its host vanished (the session's ``wait_timeout``; the holder pings every
:data:`PING_EVERY` seconds to keep its own session). A lock held therefore means a live
run, or one cut off from the database for less than that; a free lock means no run.

SQLite, the single-process embedded default, has no named locks: every lock is held.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, Select
from sqlalchemy.exc import SQLAlchemyError

from bridge.queue import statements as sql
from bridge.queue.dialect import is_mysql
from bridge.queue.model import Lease
from bridge.queue.retry import retrying

log = logging.getLogger(__name__)

T = TypeVar("T")

PING_EVERY = 2.0  # seconds between the holder's pings, while it holds a lock
IDLE_TIMEOUT = 10  # seconds the server keeps a silent holder's session (and its locks)
LOOK_CHUNK = 500  # locks looked at in one statement


def run_lock_key(database: str | None, task_id: int) -> str:
    """The named lock of one task: named locks are per server, so the database is part
    of it; hashed, since a name is at most 64 characters. ``statements.run_lock_key_of``
    is its SQL twin, and the two must agree."""
    digest = hashlib.md5(f"{database or ''}:{task_id}".encode(), usedforsecurity=False)
    return sql.RUN_LOCK_PREFIX + digest.hexdigest()


def one_row(statement: Select[Any]) -> Callable[[Connection], tuple[Any, ...]]:
    return lambda conn: tuple(conn.execute(statement).one())


class RunLocks:
    """This process's run locks, on one connection its threads share."""

    def __init__(self, engine: Engine, attempts: int = 5) -> None:
        self.engine, self.attempts = engine, attempts
        self.database = engine.url.database
        self._mysql = is_mysql(engine)
        self._conn: Connection | None = None
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._pinger: threading.Thread | None = None
        self._used = 0.0  # monotonic time of the connection's last statement

    def key(self, lease: Lease) -> str:
        return run_lock_key(self.database, lease.task_id)

    def hold(self, leases: Sequence[Lease], wait: float = 0) -> list[bool]:
        """Take each lease's task's lock; False where a live run holds it: elsewhere, or in this
        process already (a named lock is re-entrant for its session, so another thread's
        run would look free). ``wait``: seconds to wait for the first (a dead holder's
        locks are freed all at once, a moment after its death). Raises
        ``DatabaseUnavailable`` after the retries."""
        if not self._mysql or not leases:
            return [True] * len(leases)
        keys = [self.key(lease) for lease in leases]

        def take(conn: Connection) -> list[bool]:
            ask = [key for key in dict.fromkeys(keys) if key not in self._held]
            row = conn.execute(sql.take_run_locks(ask, wait)).one() if ask else ()
            taken = dict(zip(ask, row, strict=True))
            self._held.update(key for key, ok in taken.items() if ok)
            return [bool(taken.get(key)) for key in keys]

        held = self._execute("run locks", take)
        self._keep_alive()
        return held

    def free(self, leases: Sequence[Lease]) -> list[bool]:
        """Whether no live session holds each lease's task's lock (none is taken). Raises
        ``DatabaseUnavailable`` after the retries."""
        if not self._mysql or not leases:
            return [False] * len(leases)
        keys = [self.key(lease) for lease in leases]
        return [
            bool(value)
            for at in range(0, len(keys), LOOK_CHUNK)
            for value in self._execute(
                "run locks", one_row(sql.free_run_locks(keys[at : at + LOOK_CHUNK]))
            )
        ]

    def release(self, leases: Sequence[Lease]) -> None:
        """Let go of these leases' locks (their outcomes are written, or never will be
        here). A failure is only logged: a lost connection has freed them already."""
        if not self._mysql or not leases:
            return
        keys = [self.key(lease) for lease in leases]
        with self._lock:
            self._held.difference_update(keys)
        try:
            self._execute("run locks", one_row(sql.release_run_locks(keys)))
        except Exception as exc:
            log.warning("could not release %d run lock(s): %s", len(keys), exc)

    def close(self) -> None:
        """Let go of every lock: the connection ends (the server frees them with it)."""
        with self._lock:
            self._held.clear()
            self._drop()

    def _execute(self, what: str, use: Callable[[Connection], T]) -> T:
        """``use`` the locks' connection, under this process's lock, with retries."""

        def attempt() -> T:
            with self._lock:
                try:
                    result = use(self._connection())
                    self._used = time.monotonic()
                    return result
                except SQLAlchemyError:
                    self._drop()
                    raise

        return retrying(what, attempt, self.attempts)

    def _connection(self) -> Connection:
        """The locks' connection; a new one takes the held locks again, since the server
        freed them with the old session (those a redelivered copy took meanwhile are lost,
        and said so: that copy handed its lease back, and this run's outcome will find
        its fence gone). One silent for half the idle timeout with no lock held is
        replaced unasked: the server may have ended it."""
        if (
            self._conn is not None
            and not self._held
            and time.monotonic() - self._used > IDLE_TIMEOUT / 2
        ):
            self._drop()
        if self._conn is None:
            # Uncached: a statement has a column per lock, so its shape changes with the
            # count, and caching each count a worker meets (up to 500, each as wide as
            # its batch) kept tens of MB and pushed the queue's statements out.
            conn = self.engine.connect().execution_options(compiled_cache=None)
            conn.execute(sql.set_idle_timeout(IDLE_TIMEOUT))
            self._conn = conn
            if self._held:
                keys = sorted(self._held)
                taken = conn.execute(sql.take_run_locks(keys, 0)).one()
                lost = {k for k, ok in zip(keys, taken, strict=True) if not ok}
                if lost:
                    log.warning("run locks: %d lock(s) lost with a connection", len(lost))
                self._held -= lost
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                conn.invalidate()
                conn.close()
            except SQLAlchemyError:
                log.debug("run lock connection already closed", exc_info=True)

    def _keep_alive(self) -> None:
        with self._lock:
            if self._pinger is None or not self._pinger.is_alive():
                self._pinger = threading.Thread(target=self._ping, name="run-locks", daemon=True)
                self._pinger.start()

    def _ping(self) -> None:
        """Keep the session (and the locks) while any is held: a silent one is ended by
        the server after :data:`IDLE_TIMEOUT`."""
        while True:
            time.sleep(PING_EVERY)
            with self._lock:
                if not self._held:
                    continue
                try:
                    self._connection().execute(sql.PING)
                    self._used = time.monotonic()
                except SQLAlchemyError as exc:
                    log.warning("run locks: ping failed: %s", exc)
                    self._drop()
