"""The bridge's error hierarchy: one root, so callers can catch what the bridge raises on purpose.

``ConfigError`` is also a ``ValueError`` (a bad value is what it is), and names the setting
first, so the last line of any traceback says which variable to fix.
"""

from __future__ import annotations


class BridgeError(Exception):
    """Root of every error the bridge raises deliberately."""


class ConfigError(BridgeError, ValueError):
    """A ``BRIDGE_*`` setting that cannot be used; ``str()`` is ``"NAME: problem"``."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting}: {problem}")
        self.setting = setting
        self.problem = problem


class DuplicateHandlerError(BridgeError):
    """Two handlers claim one task class: which one runs must not depend on load order."""


class TaskNotDone(BridgeError):
    """A run that did not end in success, raised so Celery and Flower record a FAILURE
    (a temporary failure: a RETRY, whose ``celery.exceptions.Retry`` carries it).

    Expected (the Celery task's ``throws``): logged in one line without a traceback, and
    the message is acked; the bridge, from the database, decides whether the task runs
    again.
    """


class TaskFailed(TaskNotDone):
    """A temporary failure: the bridge runs the task again after its wait (Celery's
    state is RETRY, the ``Retry`` carrying this error)."""


class TaskFailedPermanently(TaskNotDone):
    """A permanent failure: archived with result 1."""


class LeaseLost(TaskNotDone):
    """The lease was no longer this run's: nothing was written."""


class TaskNotServed(TaskNotDone):
    """No handler serves the class here any more: the lease was handed back."""


class OutcomeUnreported(TaskNotDone):
    """The database stayed unreachable: the lease will expire and the task run again."""


class BatchNotDone(TaskNotDone):
    """A batch in which some task did not succeed (or yield): each one's line follows.
    A RETRY's when each of them failed temporarily."""
