"""The Celery runtime: the tasks, beat's scheduler, worker hooks and Celery's settings
around the Celery-free engine (``bridge.engine``), registered on an app by
:func:`install`."""

from __future__ import annotations

from celery import Celery


def install(app: Celery) -> None:
    """Register the bridge's tasks, signals and worker options on ``app``."""
    from bridge.runtime import (
        canary_guard,
        daemon_console,
        lifecycle,
        liveness,
        poller,
        quiet_polls,
        standby,
        tasks,
    )

    tasks.install(app)
    poller.install(app)
    canary_guard.install(app)
    quiet_polls.install()
    daemon_console.install()
    lifecycle.install(app)
    liveness.install(app)
    standby.install(app)
