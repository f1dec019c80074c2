"""phorge-bridge: run Phorge's work queue on Celery.

What a handler author needs is importable from here; the testing helper is
``bridge.handlers.testing.run``. Importing this package loads neither Celery nor a
database driver (``celery -A bridge`` finds the app in ``bridge.celery``).
"""

from bridge.errors import BridgeError, ConfigError
from bridge.handlers.api import (
    Handler,
    PermanentFailure,
    TaskContext,
    TemporaryFailure,
    Yield,
    handler,
)
from bridge.handlers.outcome import HandlerResult
from bridge.queue.model import NewTask, Outcome

__all__ = [
    "BridgeError",
    "ConfigError",
    "Handler",
    "HandlerResult",
    "NewTask",
    "Outcome",
    "PermanentFailure",
    "TaskContext",
    "TemporaryFailure",
    "Yield",
    "handler",
]
