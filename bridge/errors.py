"""The bridge's error hierarchy: one root, so callers can catch what the bridge raises on purpose.

Every error lives here, whichever layer raises it, and is importable from ``bridge``:
this module imports nothing of the bridge, so every layer can raise them. The modules
that raise them import them from here, and only the handler API re-exports its outcome
exceptions (``bridge.handlers.api``).

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


# -- how a handler's run ends other than by returning (``bridge.handlers.api``) ------------


class Yield(BridgeError):
    """Give the task back for ``delay`` seconds (at least 5) without counting a failure.

    Every handler exception takes the message first and ``delay`` by keyword."""

    def __init__(self, message: str = "", *, delay: int) -> None:
        super().__init__(message or f"yielded for {delay}s")
        self.delay = int(delay)


class HandBack(BridgeError):
    """The task did not run here (this worker's transport for it is down): give its lease
    back at once, no failure counted, for another worker to run it now."""


class PermanentFailure(BridgeError):
    """Archive the task with result 1 (failure); it is never retried."""


class TemporaryFailure(BridgeError):
    """Retry the task later; ``delay`` (seconds) overrides the handler's wait before retry."""

    def __init__(self, message: str = "", *, delay: int | None = None) -> None:
        super().__init__(message)
        self.delay = None if delay is None else int(delay)


# -- how a run that did not succeed ends in Celery (``bridge.runtime``) ----------------------


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


# -- the database (``bridge.queue.retry``) ---------------------------------------------------


class DatabaseUnavailable(BridgeError):
    """The database kept failing through every attempt."""


class WritesRefused(DatabaseUnavailable):
    """The database answers but refuses writes (read-only, or full): nothing was written,
    and nothing will be until an operator or a failover ends it."""


# -- the Conduit transport (``bridge.transports.conduit.client``) -------------------------


class ConduitError(BridgeError):
    """Conduit call failed; ``error_code``/``error_info`` are Phorge's, when it answered."""

    def __init__(
        self,
        method: str,
        message: str,
        *,
        error_code: str | None = None,
        error_info: str | None = None,
    ) -> None:
        super().__init__(message)
        self.method = method
        self.error_code = error_code
        self.error_info = error_info


class ConduitAuthError(ConduitError):
    """Phorge refused the caller (bad, expired or unprivileged token): an operator must act."""


class ConduitMethodNotFoundError(ConduitError):
    """The method is not installed on that Phorge (e.g. the bridge extension is missing)."""


class ConduitTransportError(ConduitError):
    """No usable Conduit answer: network error, timeout, redirect, 5xx or a non-JSON body."""

    def __init__(self, method: str, message: str, *, http_status: int | None = None) -> None:
        super().__init__(method, message)
        self.http_status = http_status


class ConduitTimeoutError(ConduitTransportError):
    """Connecting or waiting for the answer took longer than the configured timeout.

    ``sent``: the request reached Phorge (a read timeout), so PHP may still be running it.
    """

    def __init__(self, method: str, message: str, *, sent: bool) -> None:
        super().__init__(method, message)
        self.sent = sent


# -- Phorge's side: its checkout and the PHP runner (``bridge.phorge``) ----------------------


class PhorgeRootError(BridgeError, ValueError):
    """The given directory is not a Phorge checkout."""


class RunnerBootError(BridgeError):
    """The runner could not bootstrap Phorge (wrong path, database down, PHP missing):
    no task's fault."""


class RunnerDied(BridgeError):
    """The process ended during a request (a fatal error, ``exit()``, a signal); the
    message says which, in PHP's words."""


class RunnerKilled(RunnerDied):
    """The process was killed from outside (SIGKILL, SIGTERM: the OOM killer, an
    operator), not by its task's own fatal error, ``exit()`` or crash."""


class RunnerTimedOut(RunnerDied):
    """The request ran past its deadline, and the process was killed."""
