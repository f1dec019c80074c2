"""A transport's availability: whether the place PHP-only work runs can take it now.

A transport going away (Conduit's web tier refusing, resetting, answering 502/503/504 or
an HTML page, or refusing the bridge's token; the PHP runner unable to boot) is not the
task's failure. While it lasts, every task of the transport would otherwise fail and wait
out a retry. The availability turns *down* on the first such error, logs once, and lets
nothing through until a cheap probe succeeds (a circuit breaker). Probes back off from
1 s to 60 s (the runner's to 5 s), each wait a quarter of the outage so far: Phorge is
not hammered through a long outage, yet work resumes within a quarter of the outage's
length (and within a second of a short one) once it answers. The first success turns it
up again (logged once), so work resumes on the next poll.

Each process keeps its own (no shared store, no host clock: only ``time.monotonic``).
The process running ``bridge.poll`` may never run such a task, so the poller calls
:meth:`Availability.verify`, which also probes when the last evidence of an available
transport is older than :data:`RECHECK_SECONDS`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MIN_BACKOFF = 1.0
MAX_BACKOFF = 60.0
BACKOFF_SHARE = 0.25  # of the outage so far
RECHECK_SECONDS = 5.0

# The probe returns None when the transport is usable, else why it is not.
Probe = Callable[[], "str | None"]


class Availability:
    """One transport's, in one process: ``is_down`` while its breaker is open;
    ``listeners`` hear every change (True: down)."""

    def __init__(
        self,
        probe: Probe,
        *,
        name: str = "Conduit",
        clock: Callable[[], float] = time.monotonic,
        min_backoff: float = MIN_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
        recheck: float = RECHECK_SECONDS,
    ) -> None:
        self._probe = probe
        self.name = name
        self._clock = clock
        self._min_backoff = min_backoff
        self._max_backoff = max_backoff
        self._recheck = recheck
        self._opened = 0.0
        self._next_probe = 0.0
        self._seen_up = -math.inf  # when the transport last answered
        self._lock = threading.RLock()
        self.is_down = False
        self.reason = ""
        self.listeners: list[Callable[[bool], None]] = []

    def success(self) -> None:
        """The transport answered (for Conduit: any Conduit JSON answer, whatever the
        task's outcome)."""
        with self._lock:
            self._seen_up = self._clock()
            if self.is_down:
                log.warning("%s is available again: resuming PHP-only tasks", self.name)
                self._change(False, "")

    def failure(self, reason: str) -> None:
        """The transport is unusable; opens the breaker (once) and schedules the first probe."""
        with self._lock:
            if self.is_down:
                return
            log.error(
                "%s is unavailable; PHP-only tasks are held back (no failure counted) "
                "until it answers again: %s",
                self.name,
                reason,
            )
            self._opened = self._clock()
            self._next_probe = self._opened + self._min_backoff
            self._change(True, reason)

    def allow(self) -> bool:
        """May a task use the transport now? An open breaker probes once its wait is over."""
        with self._lock:
            if not self.is_down:
                return True
            return self._clock() >= self._next_probe and self._try()

    def next_probe_in(self) -> float:
        """Seconds until an open breaker probes again (0 when closed): how long work for
        this transport is better left to other workers."""
        with self._lock:
            return max(0.0, self._next_probe - self._clock()) if self.is_down else 0.0

    def verify(self) -> bool:
        """:meth:`allow`, but a closed breaker probes too when its last evidence is stale."""
        with self._lock:
            if not self.is_down and self._clock() - self._seen_up < self._recheck:
                return True
            return self.allow() if self.is_down else self._try()

    def _try(self) -> bool:
        reason = self._probe()
        if reason is None:
            self.success()
            return True
        if self.is_down:
            now = self._clock()
            wait = (now - self._opened) * BACKOFF_SHARE
            wait = min(max(wait, self._min_backoff), self._max_backoff)
            self._next_probe = now + wait
            log.debug("%s still unavailable, next probe in %.0fs: %s", self.name, wait, reason)
        else:
            self.failure(reason)
        return False

    def _change(self, is_down: bool, reason: str) -> None:
        self.is_down, self.reason = is_down, reason
        for listener in self.listeners:
            listener(is_down)
