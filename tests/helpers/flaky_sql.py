"""Database errors injected into the per-task session, for the faults a test cannot make
the server produce on cue (a table full, a deadlock at one statement)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import MySQLdb

from bridge.queue.session import LeaseSession


def database_blip() -> Exception:
    return MySQLdb.OperationalError(2013, "Lost connection to server during query")


def flaky(
    method: Callable[..., Any], failures: int, error: Callable[[], Exception] = database_blip
) -> Any:
    """``method``, raising ``error()`` on its first ``failures`` calls."""
    calls = {"n": 0}

    def call(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] <= failures:
            raise error()
        return method(*args, **kwargs)

    return call


def flaky_statement(
    monkeypatch: Any,
    statement: object,
    failures: int,
    error: Callable[[], Exception] = database_blip,
) -> None:
    """The session's ``statement`` fails (by default with a database blip) on its first
    ``failures`` runs."""
    compile_ = flaky(LeaseSession._compile, failures, error)
    original = LeaseSession._compile
    monkeypatch.setattr(
        LeaseSession,
        "_compile",
        lambda self, s: compile_(self, s) if s is statement else original(self, s),
    )
