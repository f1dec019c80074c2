"""Whether the database accepts writes, as this process last found: the write gate.

A primary that turns read-only (a failover, maintenance, a managed switchover) or runs
out of room still answers reads, so a worker could go on running tasks whose outcomes
it cannot write, and their leases would expire and run them again. So the first
refused write closes the gate: no task starts while it is closed, an outcome already
run is held and tried again for as long as its lease lasts, and a cheap write that
changes nothing (:meth:`PhorgeQueue.probe_writes`) reopens it once writes are accepted.
Each change is logged once, and shown by a gauge.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from bridge.engine.observers import observers
from bridge.errors import DatabaseUnavailable, WritesRefused

log = logging.getLogger(__name__)

PROBE_INTERVAL = 0.5  # seconds between two tries while writes are refused


class WriteGate:
    """Open while the database accepts this process's writes (thread-safe)."""

    def __init__(
        self,
        probe: Callable[[], None],
        *,
        interval: float = PROBE_INTERVAL,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._probe = probe
        self.interval = interval
        self._sleep = sleep
        self._lock = threading.Lock()
        self._closed_at: float | None = None
        self.is_open = True

    def refused(self, exc: BaseException) -> None:
        """A write was refused: close the gate (logged once, until it opens again)."""
        with self._lock:
            if self._closed_at is not None:
                return
            self._closed_at, self.is_open = time.monotonic(), False
        for observer in observers():
            observer.writes_refused(True)
        log.error(
            "the database refuses writes (%s): no task starts, and outcomes already run are "
            "held until it accepts them again",
            exc,
        )

    def accepted(self) -> None:
        """A write went through: open the gate (logged once)."""
        with self._lock:
            if self._closed_at is None:
                return
            closed_for, self._closed_at = time.monotonic() - self._closed_at, None
            self.is_open = True
        for observer in observers():
            observer.writes_refused(False)
        log.warning("the database accepts writes again, after %.1f s", closed_for)

    def pause(self) -> None:
        """Wait before the next try of a refused write."""
        self._sleep(self.interval)

    def wait_open(self, timeout: float) -> bool:
        """Probe until writes are accepted or ``timeout`` seconds have passed; returns
        whether the gate is open."""
        deadline = time.monotonic() + timeout
        while not self.is_open:
            try:
                self._probe()
            except WritesRefused:
                pass
            except DatabaseUnavailable as exc:
                log.warning("write probe: %s", exc)
            else:
                self.accepted()
                break
            if time.monotonic() >= deadline:
                break
            self.pause()
        return self.is_open
