"""One line naming the setting, instead of a traceback, when the database or broker fails.

A refused connection or a missing table is a setting for the operator to fix, not a bug
in the bridge: every command ends with that line and exit status 1, through the command
group (:class:`ServiceErrorsGroup`) rather than a handler per command.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import click
from kombu.exceptions import OperationalError as BrokerError
from kombu.utils.url import maybe_sanitize_url
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from bridge.config import Settings, load_settings
from bridge.errors import DatabaseUnavailable
from bridge.queue import retry

DATABASE_ERRORS = (SQLAlchemyError, DatabaseUnavailable)
MISSING_TABLE_WORDS = ("no such table", "doesn't exist")  # SQLite's, MySQL's (1146)


def driver_error(exc: BaseException) -> BaseException:
    """The driver's own error under the bridge's retry wrapper and SQLAlchemy's."""
    while isinstance(exc, DatabaseUnavailable) and exc.__cause__ is not None:
        exc = exc.__cause__
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        return exc.orig
    return exc


def first_line(exc: BaseException) -> str:
    """SQLAlchemy appends the statement and a link on later lines: the first one says it."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _in_force(url: Callable[[Settings], str]) -> str:
    """The URL the command used, its password hidden ("" if the settings fail)."""
    with contextlib.suppress(Exception):
        return f" ({url(load_settings())})"
    return ""


def database_problem(exc: BaseException) -> str:
    cause = driver_error(exc)
    url = _in_force(lambda settings: make_url(settings.database_url).render_as_string())
    line = f"database error: {first_line(cause)}; check BRIDGE_DATABASE_URL{url}"
    if any(words in str(cause) for words in MISSING_TABLE_WORDS):
        line += (
            ": it must name Phorge's {namespace}_worker database "
            "(an empty SQLite file needs `phorge-bridge create-tables`)"
        )
    return line


def broker_problem(exc: BaseException) -> str:
    url = _in_force(lambda settings: maybe_sanitize_url(settings.broker_url))
    return f"broker error: {first_line(exc)}; check BRIDGE_BROKER_URL{url}"


@contextlib.contextmanager
def quiet_retries() -> Iterator[None]:
    """Hold back the queue's warnings about transient errors it tries again: a command
    either gets through, or ends with the one line saying what failed."""
    retries = logging.getLogger(retry.__name__)
    level = retries.level
    retries.setLevel(logging.ERROR)
    try:
        yield
    finally:
        retries.setLevel(level)


class ServiceErrorsGroup(click.Group):
    """A command group whose commands end a database or broker error with one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with quiet_retries():
                return super().invoke(ctx)
        except DATABASE_ERRORS as exc:
            raise click.ClickException(database_problem(exc)) from None
        except BrokerError as exc:
            raise click.ClickException(broker_problem(exc)) from None
