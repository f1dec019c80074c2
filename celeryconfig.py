"""An operator's Celery settings: the bridge's own, with overrides below.

Celery reads this module only when told to: ``CELERY_CONFIG_MODULE=celeryconfig celery
-A bridge worker``. The bridge's settings come from ``BRIDGE_*`` variables; put here
only Celery settings the bridge does not derive from them.
"""

from bridge.runtime.celeryconfig import *  # noqa: F403

# Replace a worker child after this many tasks, should a handler leak memory.
worker_max_tasks_per_child = 100_000
