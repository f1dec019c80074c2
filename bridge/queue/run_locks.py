"""Run locks: which leases a live process is running now, as the database sees it.

A message redelivered by the broker (its worker died, or only its broker connection
did) carries a lease whose run may be dead or still going; the broker cannot tell the
two apart, and a second run of a live one would repeat its side effects. So every
process holds MySQL's named lock of each lease it runs (:func:`run_lock_key`), on a
connection of its own, from before the lease's check until its outcome is written. The
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
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, Select
from sqlalchemy.exc import SQLAlchemyError

from bridge.queue import statements as sql
from bridge.queue.dialect import is_mysql
from bridge.queue.model import Lease
from bridge.queue.retry import retrying

log = logging.getLogger(__name__)

PING_EVERY = 2.0  # seconds between the holder's pings, while it holds a lock
IDLE_TIMEOUT = 10  # seconds the server keeps a silent holder's session (and its locks)


def run_lock_key(database: str | None, owner: str, task_id: int) -> str:
    """The named lock of one lease: named locks are per server, so the database is part
    of it; hashed, since a name is at most 64 characters. ``statements.run_lock_key_of``
    is its SQL twin, and the two must agree."""
    digest = hashlib.md5(f"{database or ''}:{owner}:{task_id}".encode(), usedforsecurity=False)
    return sql.RUN_LOCK_PREFIX + digest.hexdigest()


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

    def key(self, lease: Lease) -> str:
        return run_lock_key(self.database, lease.owner, lease.task_id)

    def hold(self, leases: Sequence[Lease], wait: float = 0) -> list[bool]:
        """Take each lease's lock; False where a live run elsewhere holds it. ``wait``:
        seconds to wait for the first (a dead holder's locks are freed all at once, a
        moment after its death). Raises ``DatabaseUnavailable`` after the retries."""
        if not self._mysql or not leases:
            return [True] * len(leases)
        keys = [self.key(lease) for lease in leases]
        taken = self._execute("run locks", sql.take_run_locks(keys, wait))
        held = [bool(value) for value in taken]
        with self._lock:
            self._held.update(k for k, ok in zip(keys, held, strict=True) if ok)
        self._keep_alive()
        return held

    def release(self, leases: Sequence[Lease]) -> None:
        """Let go of these leases' locks (their outcomes are written, or never will be
        here). A failure is only logged: a lost connection has freed them already."""
        if not self._mysql or not leases:
            return
        keys = [self.key(lease) for lease in leases]
        with self._lock:
            self._held.difference_update(keys)
        try:
            self._execute("run locks", sql.release_run_locks(keys))
        except Exception as exc:
            log.warning("could not release %d run lock(s): %s", len(keys), exc)

    def close(self) -> None:
        """Let go of every lock: the connection ends (the server frees them with it)."""
        with self._lock:
            self._held.clear()
            self._drop()

    def _execute(self, what: str, statement: Select[Any]) -> tuple[Any, ...]:
        def attempt() -> tuple[Any, ...]:
            with self._lock:
                try:
                    conn = self._connection()
                    return tuple(conn.execute(statement).one())
                except SQLAlchemyError:
                    self._drop()
                    raise

        return retrying(what, attempt, self.attempts)

    def _connection(self) -> Connection:
        """The locks' connection; a new one takes the held locks again, since the server
        freed them with the old session (those a redelivered copy took meanwhile are lost,
        and said so: that copy handed its lease back, and this run's outcome will find
        its fence gone)."""
        if self._conn is None:
            conn = self.engine.connect()
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
                except SQLAlchemyError as exc:
                    log.warning("run locks: ping failed: %s", exc)
                    self._drop()
