"""The beat lock: which of several ``celery beat`` processes sends the polls.

Beat is one process by design, so one host would be the queue's single point of
failure; two beats would double the polls' idle load on the database. So every beat
tries MySQL's named lock ``<prefix>:beat`` on a connection of its own: the one holding
it sends the polls, the others stand by and try again every :data:`CHECK_EVERY`
seconds. The server frees the lock when the holder's connection ends: at once when its
process dies, and within :data:`IDLE_TIMEOUT` seconds when its host vanishes (the
session's ``wait_timeout``; the holder's checks keep its own session alive). A poll
that two beats send in the handover is harmless: polls take the poll lock.

SQLite, the single-process embedded default, has no named locks: its beat always sends.
"""

from __future__ import annotations

import logging
import time

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from bridge.queue import statements as sql
from bridge.queue.dialect import is_mysql, lock_key

log = logging.getLogger(__name__)

CHECK_EVERY = 2.0  # seconds between two checks of the lock, by holder and standby
IDLE_TIMEOUT = 10  # seconds the server keeps a silent holder's session (and its lock)


def beat_lock_name(owner_prefix: str) -> str:
    return f"{owner_prefix}:beat"


class BeatLock:
    """Whether this beat sends the polls (see the module's docstring)."""

    def __init__(self, engine: Engine, owner_prefix: str) -> None:
        self.engine = engine
        self.key = lock_key(engine, beat_lock_name(owner_prefix))
        self._conn: Connection | None = None
        self._held: bool | None = None  # unknown until the first check
        self._checked = -CHECK_EVERY

    def held(self) -> bool:
        """True while this process holds the lock, taking it when it is free; asks the
        server at most every :data:`CHECK_EVERY` seconds."""
        if not is_mysql(self.engine):
            return True
        now = time.monotonic()
        if now - self._checked >= CHECK_EVERY:
            self._checked = now
            self._report(self._ask())
        return bool(self._held)

    def _ask(self) -> bool:
        try:
            if self._conn is None:
                self._conn = self.engine.connect()
                self._conn.execute(sql.set_idle_timeout(IDLE_TIMEOUT))
            if self._conn.execute(sql.lock_held_here(self.key)).scalar_one():
                return True
            return bool(self._conn.execute(sql.get_lock(self.key)).one()[0])
        except SQLAlchemyError as exc:  # a lost connection loses the lock too: stand by
            log.warning("beat: cannot check the beat lock %s: %s", self.key, exc)
            self.close()
            return False

    def _report(self, held: bool) -> None:
        if held != self._held:
            if held:
                log.info("beat: this beat sends the polls (it holds %s)", self.key)
            else:
                log.info("beat: standing by; another beat holds %s", self.key)
        self._held = held

    def close(self) -> None:
        """End the lock's connection (the server frees the lock with it)."""
        if self._conn is not None:
            try:
                self._conn.invalidate()  # closed for good, not returned to the pool
                self._conn.close()
            except SQLAlchemyError:  # already gone with the server
                log.debug("beat lock connection already closed", exc_info=True)
            self._conn = None


def beat_lock_holder(engine: Engine, owner_prefix: str) -> int | None:
    """The connection id of the beat that sends the polls, or None when no beat holds
    the lock (doctor and the metrics tell the operator); MySQL only."""
    with engine.connect() as conn:
        holder = conn.execute(sql.lock_holder(lock_key(engine, beat_lock_name(owner_prefix))))
        value = holder.scalar_one()
    return None if value is None else int(value)
