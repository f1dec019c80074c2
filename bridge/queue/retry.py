"""The one retry policy for transient database errors, applied around whole transactions.

A transaction that failed with a deadlock or a lock wait timeout was rolled back whole,
and every write the bridge makes is fenced by its lease, so running it again is safe:
at worst the fence no longer holds and nothing is written. A lost connection may have
taken a COMMIT with it (``fate_unknown``): the writer asks the row whether its write
happened. A database that refuses writes (read-only, full) is not retried here: it
raises :class:`WritesRefused` at once, and the engine holds its work until it ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError

from bridge.errors import DatabaseUnavailable, WritesRefused

log = logging.getLogger(__name__)
T = TypeVar("T")

# InnoDB's "deadlock found" and "lock wait timeout", and the client's "server has gone
# away", "lost connection", "can't connect": worth another try.
_RETRYABLE_MYSQL_CODES = frozenset({1213, 1205, 2002, 2003, 2006, 2013, 2055})
# The connection went away while a statement was in flight: whether a COMMIT sent with
# it happened is unknown, and only the row can tell.
_FATE_UNKNOWN_MYSQL_CODES = frozenset({2006, 2013, 2055})
# The server refuses every write for now, whoever sends it: read-only (1290: --read-only,
# which MySQL 8's super_read_only also raises; 1792: a read-only transaction; 1836:
# MariaDB's read-only mode; 1874: InnoDB read-only), or out of room (1114: the table is
# full; 1021: the disk is). Retrying at once would only repeat the refusal.
_REFUSED_WRITE_MYSQL_CODES = frozenset({1290, 1792, 1836, 1874, 1114, 1021})


def _mysql_code(exc: BaseException) -> int | None:
    """The MySQL error code of ``exc`` (SQLAlchemy's or the driver's own), if it has one."""
    if isinstance(exc, DBAPIError):
        exc = exc.orig if exc.orig is not None else exc
    if not type(exc).__module__.startswith("MySQLdb"):
        return None
    return exc.args[0] if exc.args and isinstance(exc.args[0], int) else None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (SQLAlchemy's or the driver's own) is worth trying again."""
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig if exc.orig is not None else exc
    if type(exc).__module__.startswith("MySQLdb"):
        return _mysql_code(exc) in _RETRYABLE_MYSQL_CODES
    if type(exc).__module__ == "sqlite3":
        return "locked" in str(exc) or "busy" in str(exc)
    return False


def refuses_writes(exc: BaseException) -> bool:
    """Whether ``exc`` says the database refuses writes (see :class:`WritesRefused`)."""
    if isinstance(exc, WritesRefused):
        return True
    if _mysql_code(exc) in _REFUSED_WRITE_MYSQL_CODES:
        return True
    # SQLite: a read-only file or a full disk, the embedded default's equivalents.
    text = str(exc)
    return "readonly database" in text or "database or disk is full" in text


def fate_unknown(exc: BaseException) -> bool:
    """Whether ``exc`` lost the connection with a statement in flight (a COMMIT sent
    with it may or may not have happened)."""
    return _mysql_code(exc) in _FATE_UNKNOWN_MYSQL_CODES


def retrying(what: str, call: Callable[[], T], attempts: int = 5) -> T:
    """``call()``, again after a transient error, with backoff, at most ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as exc:
            if refuses_writes(exc) and not isinstance(exc, WritesRefused):
                raise WritesRefused(f"{what}: {exc}") from exc
            if not is_transient(exc):
                raise
            if attempt == attempts:
                raise DatabaseUnavailable(f"{what}: {exc}") from exc
            log.warning("%s: database error (attempt %d/%d): %s", what, attempt, attempts, exc)
            time.sleep(min(0.05 * 2**attempt, 5.0))
    raise AssertionError("unreachable")
