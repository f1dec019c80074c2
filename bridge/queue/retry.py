"""The one retry policy for transient database errors, applied around whole transactions.

A transaction that failed with a lost connection, a deadlock or a lock wait timeout was
rolled back whole, and every write the bridge makes is fenced by its lease, so running
it again is safe: at worst the fence no longer holds and nothing is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError

from bridge.errors import BridgeError

log = logging.getLogger(__name__)
T = TypeVar("T")

# InnoDB's "deadlock found" and "lock wait timeout", and the client's "server has gone
# away", "lost connection", "can't connect": worth another try.
_RETRYABLE_MYSQL_CODES = frozenset({1213, 1205, 2002, 2003, 2006, 2013, 2055})


class DatabaseUnavailable(BridgeError):
    """The database kept failing through every attempt."""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (SQLAlchemy's or the driver's own) is worth trying again."""
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig if exc.orig is not None else exc
    module = type(exc).__module__
    if module.startswith("MySQLdb"):
        code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
        return code in _RETRYABLE_MYSQL_CODES
    if module == "sqlite3":
        return "locked" in str(exc) or "busy" in str(exc)
    return False


def retrying(what: str, call: Callable[[], T], attempts: int = 5) -> T:
    """``call()``, again after a transient error, with backoff, at most ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if attempt == attempts:
                raise DatabaseUnavailable(f"{what}: {exc}") from exc
            log.warning("%s: database error (attempt %d/%d): %s", what, attempt, attempts, exc)
            time.sleep(min(0.05 * 2**attempt, 5.0))
    raise AssertionError("unreachable")
