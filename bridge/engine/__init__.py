"""The engine: lease, run and report Phorge tasks, with no Celery in sight.

``context`` builds the per-process runtime (queue, registry, lease keeper), ``poll``
plans and leases a poll, ``run`` runs one leased task, ``batch`` runs a message's tasks
and writes their outcomes, ``lease_keeper``, ``tracing`` and ``metrics`` serve them.
The Celery tasks in ``bridge.runtime`` are thin wrappers around it, and the CLI and
the benchmark use it directly, through the seams importable from here: ``build_runtime``,
``run_task``, ``Batch``, ``poll_once``, and ``observe`` with a ``RunObserver``. Importing
it reads no environment: settings are read when the first runtime is built, or passed in.
"""

from bridge.engine.batch import Batch, run_task
from bridge.engine.context import build_runtime
from bridge.engine.poll import poll_once
from bridge.engine.run import RunObserver, observe

__all__ = ["Batch", "RunObserver", "build_runtime", "observe", "poll_once", "run_task"]
