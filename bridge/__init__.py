"""phorge-bridge: run Phorge's work queue on Celery.

The public API is importable from here: what a handler author needs (``Handler``,
``@handler``, ``TaskContext`` and the outcome exceptions), the queue's records
(``NewTask``, ``Task``, ``TaskFilter``, ``Outcome``), and every error the bridge raises
on purpose, all under ``BridgeError``, all defined in ``bridge.errors``. The testing
helper is ``bridge.handlers.testing.run``; the queue itself is ``bridge.queue.PhorgeQueue``.
Importing this package loads neither Celery nor a database driver (``celery -A bridge``
finds the app in ``bridge.celery``).
"""

from bridge._version import __version__
from bridge.errors import (
    BatchNotDone,
    BridgeError,
    ConduitAuthError,
    ConduitError,
    ConduitMethodNotFoundError,
    ConduitTimeoutError,
    ConduitTransportError,
    ConfigError,
    DatabaseUnavailable,
    DuplicateHandlerError,
    HandBack,
    LeaseLost,
    OutcomeUnreported,
    PermanentFailure,
    PhorgeRootError,
    RunnerBootError,
    RunnerDied,
    RunnerKilled,
    RunnerTimedOut,
    TaskFailed,
    TaskFailedPermanently,
    TaskNotDone,
    TaskNotServed,
    TemporaryFailure,
    WritesRefused,
    Yield,
)
from bridge.handlers.api import Handler, TaskContext, handler
from bridge.handlers.outcome import HandlerResult
from bridge.queue.model import NewTask, Outcome, Task, TaskFilter

__all__ = [
    "BatchNotDone",
    "BridgeError",
    "ConduitAuthError",
    "ConduitError",
    "ConduitMethodNotFoundError",
    "ConduitTimeoutError",
    "ConduitTransportError",
    "ConfigError",
    "DatabaseUnavailable",
    "DuplicateHandlerError",
    "HandBack",
    "Handler",
    "HandlerResult",
    "LeaseLost",
    "NewTask",
    "Outcome",
    "OutcomeUnreported",
    "PermanentFailure",
    "PhorgeRootError",
    "RunnerBootError",
    "RunnerDied",
    "RunnerKilled",
    "RunnerTimedOut",
    "Task",
    "TaskContext",
    "TaskFailed",
    "TaskFailedPermanently",
    "TaskFilter",
    "TaskNotDone",
    "TaskNotServed",
    "TemporaryFailure",
    "WritesRefused",
    "Yield",
    "__version__",
    "handler",
]
