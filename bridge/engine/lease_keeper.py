"""LeaseKeeper: one thread per worker process renews the leases of its running tasks.

Most tasks end long before a third of their lease has passed, so a task costs only two
dictionary operations here; the thread wakes for the tasks that run long, renews each
every third of its lease, and stops renewing once a task has used its lease budget.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from bridge.engine.observers import observers
from bridge.errors import DatabaseUnavailable
from bridge.queue import Lease, PhorgeQueue

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Watch:
    """One running task's lease, as the keeper tracks it while the ``with`` block runs
    (a class, not a generator: every task enters one)."""

    keeper: LeaseKeeper
    lease: Lease
    label: str
    length: int  # seconds a renewal asks for
    deadline: float  # monotonic time after which the budget is spent
    next_renewal: float
    expires: float  # monotonic time the lease runs out, as last set
    lost: bool = False

    def __enter__(self) -> Watch:
        self.keeper._add(self)
        return self

    def __exit__(self, *_: object) -> None:
        self.keeper._remove(self)


class LeaseKeeper:
    """Renews leases of long-running tasks in this process from one daemon thread."""

    def __init__(self, queue: PhorgeQueue) -> None:
        self.queue = queue
        self._watches: dict[int, Watch] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, lease: Lease, label: str, length: int, budget: int) -> Watch:
        """Keep ``lease`` renewed (``length`` seconds at a time) for at most ``budget``
        seconds, while ``with keeper.watch(...) as watch:`` runs."""
        now = time.monotonic()
        expires = now + length
        length = max(length, 3)
        return Watch(self, lease, label, length, now + budget, now + length / 3, expires)

    def _add(self, watch: Watch) -> None:
        with self._lock:
            self._watches[watch.lease.task_id] = watch
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
                self._thread.start()

    def _remove(self, watch: Watch) -> None:
        with self._lock:
            self._watches.pop(watch.lease.task_id, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                due = min((w.next_renewal for w in self._watches.values()), default=None)
            # At most a second asleep, so a task that starts meanwhile is never overslept.
            time.sleep(1.0 if due is None else min(1.0, max(0.0, due - time.monotonic())))
            now = time.monotonic()
            with self._lock:
                watches = [w for w in self._watches.values() if w.next_renewal <= now]
            for watch in watches:
                self._renew(watch, now)

    def _renew(self, watch: Watch, now: float) -> None:
        left = int(watch.deadline - now)
        watch.next_renewal = now + watch.length / 3
        if left <= 0:
            watch.next_renewal = float("inf")
            log.warning("%s ran past its lease budget; the lease will expire", watch.label)
            return
        seconds = min(watch.length, left)
        try:
            renewed = self.queue.session.renew(watch.lease, seconds)
        except DatabaseUnavailable as exc:
            for observer in observers():
                observer.lease_renewed("error")
            log.warning("%s: heartbeat failed, will retry: %s", watch.label, exc)
            return
        for observer in observers():
            observer.lease_renewed("renewed" if renewed else "lost")
        if renewed:
            watch.expires = now + seconds
        if not renewed:
            watch.lost, watch.next_renewal = True, float("inf")
            log.warning("%s: lease lost while running; its result will be dropped", watch.label)
