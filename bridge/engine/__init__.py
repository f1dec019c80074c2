"""The engine: lease, run and report Phorge tasks, with no Celery, transport or metrics
library in sight.

``context`` holds a process's runtime (queue, registry, lease keeper, write gate,
outages), ``poll`` plans and leases a poll, ``run`` prepares and runs leased tasks,
``batch`` runs a message's tasks and writes their outcomes, ``observers`` tells whoever
listens what happened; ``lease_keeper``, ``writes``, ``pace``, ``outages`` and
``tracing`` serve them.
The Celery tasks in ``bridge.runtime`` are thin wrappers around it, and the CLI and the
benchmark use it directly, through the seams importable from here: ``Runtime`` (built
with ``bridge.assembly.build_runtime``, or ``open_runtime`` with a registry of your
own), ``poll_once``, ``Batch``, ``run_task``, ``RunReport``, and ``observe`` with a
``RunObserver``. Importing it reads no environment.
"""

from bridge.engine.batch import Batch, run_task
from bridge.engine.context import Runtime, open_runtime
from bridge.engine.observers import RunObserver, observe
from bridge.engine.poll import poll_once
from bridge.engine.reports import RunReport

__all__ = [
    "Batch",
    "RunObserver",
    "RunReport",
    "Runtime",
    "observe",
    "open_runtime",
    "poll_once",
    "run_task",
]
