"""``bridge.canary_guard``: beat's periodic run of the canary guard (``bridge.canary.guard``),
on the control queue beside the polls; registered on an app by :func:`install`.

Beat sends it every ``BRIDGE_CANARY_GUARD_INTERVAL`` s, only while it holds the beat
lock (``bridge.runtime.beat``), and the guard itself runs under a database lock of its
own, so two beats or two control workers never judge a class twice. While no class is
shared it reads the two options and stops. Like the poll, it shows in no task event and
Celery's INFO lines about it are dropped (``quiet_polls``): one a second would fill
Flower and the log; its rollbacks log their own ERROR line. Each judgement that ends sets
``phorge_bridge_canary_guard_last_run_timestamp_seconds``: the alert
PhorgeBridgeCanaryGuardStopped fires when it goes stale while a class is shared.

The guard is told the version of each shared class's new side from the live workers'
announcements (the consumer survey this process's polls share, refreshed every 15 s), so
that a new version is judged afresh.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from celery import Celery, Task

from bridge.assembly import runtime
from bridge.canary.guard import Suspicions, guard_once
from bridge.canary.ledger import Ledger
from bridge.canary.store import CanaryStore
from bridge.canary.weights import SCALE, Canary
from bridge.errors import DatabaseUnavailable
from bridge.metrics import GUARD_JUDGED
from bridge.queue.implementations import NATIVE, PYTHON
from bridge.queue.retry import is_transient
from bridge.routing import Router
from bridge.runtime.announce import Announcement
from bridge.runtime.poller import consumer_watch
from bridge.runtime.quiet_polls import QuietTask
from bridge.runtime.tasks import GUARD_TASK

log = logging.getLogger(__name__)

GUARD_ENTRY = "canary-guard"  # its name in beat's schedule


def serving(canary: Canary, announced: Announcement, task_class: str, level: str) -> str | None:
    """What runs ``task_class``'s new side at ``level`` on the announcing worker: its
    native handler at the python level; at the celery level, the native handler where
    the python weight gives it everything, else its PHP path."""
    coverage = announced.coverage
    native = coverage.transport_for(task_class) == NATIVE
    if level == PYTHON:
        return NATIVE if native else None
    if native and canary.weight(task_class, PYTHON) >= SCALE:
        return NATIVE
    return coverage.php_transport_for(task_class)


def new_side_versions(
    canary: Canary, nodes: Mapping[str, Announcement], router: Router
) -> dict[tuple[str, str], str]:
    """The version of each shared class's new side, from the live workers that would run
    it (every version they announce, joined: a fleet half deployed runs two)."""
    found: dict[tuple[str, str], str] = {}
    for task_class, level, _ in canary.partial():
        queue = router.queue_for(task_class)
        seen = {
            version
            for announced in nodes.values()
            if announced.runs(task_class, queue)
            and (transport := serving(canary, announced, task_class, level)) is not None
            and (version := announced.version_for(task_class, transport)) is not None
        }
        if seen:
            found[(task_class, level)] = ", ".join(sorted(seen))
    return found


_judges: dict[int, tuple[CanaryStore, Suspicions, Ledger]] = {}


def judge() -> tuple[CanaryStore, Suspicions, Ledger]:
    """This process's store of the canary options, its count of consecutive bad
    evaluations and its ledger of the long window (fresh ones in each forked child)."""
    pid = os.getpid()
    if pid not in _judges:
        rt = runtime()
        _judges.clear()
        store = CanaryStore.for_settings(rt.queue.engine, rt.settings)
        suspicions = Suspicions(rt.settings.canary_failure_limit)
        _judges[pid] = (store, suspicions, Ledger(rt.settings.canary_history))
    return _judges[pid]


def canary_guard(self: Task[Any, Any]) -> list[str]:
    """Run the guard once; returns what it did (rollbacks, ramp steps)."""
    rt = runtime()
    store, suspicions, ledger = judge()
    watch = consumer_watch(self.app, rt)

    def versions(canary: Canary) -> dict[tuple[str, str], str]:
        watch.refresh_soon()  # on a thread: the guard never waits on the control API
        return new_side_versions(canary, watch.last.nodes, rt.settings.router)

    try:
        done = guard_once(store, rt.queue.engine, rt.settings, suspicions, ledger, versions)
    except Exception as exc:
        if not (isinstance(exc, DatabaseUnavailable) or is_transient(exc)):
            raise
        log.warning("canary guard skipped: database unavailable: %s", exc)
        return []
    GUARD_JUDGED.set_to_current_time()
    return done


def install(app: Celery) -> None:
    """Register ``bridge.canary_guard`` on ``app`` (beat sends it, see ``celeryconfig``)."""
    app.task(name=GUARD_TASK, base=QuietTask, bind=True, acks_late=False, ignore_result=True)(
        canary_guard
    )
