"""The queue layer: Phorge's worker tables, read and written as Phorge's PHP does.

It knows nothing of Celery or of handlers: the runtime and the CLI build on it.
"""

from bridge.queue.actions import OperatorActions
from bridge.queue.dialect import make_engine
from bridge.queue.model import Lease, NewTask, Outcome, Task, TaskFilter
from bridge.queue.phorge_queue import PhorgeQueue

__all__ = [
    "Lease",
    "NewTask",
    "OperatorActions",
    "Outcome",
    "PhorgeQueue",
    "Task",
    "TaskFilter",
    "make_engine",
]
