"""The pool of PHP runner processes of one worker process: one per concurrent slot.

A prefork child runs one task at a time, so its pool holds one process, started when the
child starts; a threads worker of concurrency N holds up to N, each checked out by one
task at a time. A process is replaced after ``max_tasks`` tasks, at ``max_age`` seconds,
once its resident memory passes ``max_rss`` bytes, when it dies, and when the reload
stamp (a file a deploy touches) is newer than the process: only ever between two tasks,
so recycling loses nothing. Listeners hear every start and every replacement, with its
cause, for the metrics.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from bridge.config import RunnerSettings
from bridge.errors import RunnerBootError, RunnerDied, RunnerTimedOut
from bridge.transports.php_runner.process import RunnerCommand, RunnerProcess

log = logging.getLogger(__name__)

BOOT_TIMEOUT = 30.0  # seconds a process may take to bootstrap Phorge


class Restart(enum.Enum):
    """Why a process was replaced (a metric's label)."""

    TASKS = "tasks"
    AGE = "age"
    RSS = "rss"
    RELOAD = "reload"
    DIED = "died"
    DEADLINE = "deadline"


class PoolListener:
    """Hears the pool's processes come and go; override what you need."""

    def started(self, process: RunnerProcess) -> None:
        """A process booted."""

    def ended(self, process: RunnerProcess, cause: Restart | None) -> None:
        """A process ended; ``cause`` is why it was replaced, None when the pool closed."""

    def returned(self, process: RunnerProcess, rss: int) -> None:
        """A process came back from a task, with ``rss`` bytes resident."""


class RunnerPool:
    """Booted processes waiting for a task, and the rules that retire them."""

    def __init__(self, settings: RunnerSettings, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.size = 1
        self.listeners: list[PoolListener] = []
        self._clock = clock
        self._idle: list[RunnerProcess] = []
        self._running: set[RunnerProcess] = set()
        self._lock = threading.Lock()

    def warm(self, size: int | None = None) -> None:
        """Start processes until ``size`` (the concurrency, kept from now on) are live;
        they boot meanwhile, together, and a task waits for the rest of its boot. A
        retired process is replaced the same way at once.

        Raises :class:`~bridge.transports.php_runner.process.RunnerBootError` when one cannot start.
        """
        if size is not None:
            self.size = max(1, size)
        while True:
            with self._lock:
                if len(self._idle) + len(self._running) >= self.size:
                    return
            process = self._start()
            with self._lock:
                self._idle.append(process)

    def check(self) -> None:
        """Make sure one process is booted (starting one if none is live): the
        availability's probe. Raises :class:`~bridge.errors.RunnerBootError` saying why not."""
        with self.checkout():
            pass

    @contextmanager
    def checkout(self) -> Iterator[RunnerProcess]:
        """A process for one task: an idle one, else a new one (booted in this thread).

        A process that dies or is killed during the task is retired with its cause; one
        that is due (tasks, age, memory, the reload stamp) is retired when it comes back.
        The caller counts the tasks it runs (``process.tasks``).
        """
        process = self._take()
        try:
            yield process
        except RunnerDied as exc:
            cause = Restart.DEADLINE if isinstance(exc, RunnerTimedOut) else Restart.DIED
            self._retire(process, cause)
            raise
        except BaseException:
            self._retire(process, Restart.DIED)
            raise
        rss = process.rss()
        for listener in self.listeners:
            listener.returned(process, rss)
        due = self._due(process, rss)
        if due is not None:
            self._retire(process, due)
            return
        with self._lock:
            self._running.discard(process)
            if len(self._idle) < self.size:
                self._idle.append(process)
                return
        self._end(process, None)

    def close(self) -> None:
        """Stop the idle processes (worker shutdown); a running one ends with its pipe."""
        with self._lock:
            idle, self._idle = self._idle, []
        for process in idle:
            self._end(process, None)

    def _take(self) -> RunnerProcess:
        while True:
            with self._lock:
                process = self._idle.pop() if self._idle else None
                if process is not None:
                    self._running.add(process)
            if process is None:
                break
            due = self._due(process) if process.alive else Restart.DIED
            if due is None:
                return self._booted(process)
            self._retire(process, due)
        process = self._start()
        with self._lock:
            self._running.add(process)
        return self._booted(process)

    def _start(self) -> RunnerProcess:
        process = RunnerProcess(RunnerCommand(self.settings.php, self.settings.phorge_root))
        for listener in self.listeners:
            listener.started(process)
        return process

    def _booted(self, process: RunnerProcess) -> RunnerProcess:
        try:
            process.ready(BOOT_TIMEOUT)
        except BaseException:
            self._retire(process, None)
            raise
        return process

    def _due(self, process: RunnerProcess, rss: int = 0) -> Restart | None:
        """Why a process must go now (``rss``: as just read, after a task), or None."""
        settings = self.settings
        if process.tasks >= settings.max_tasks:
            return Restart.TASKS
        if self._clock() - process.born >= settings.max_age:
            return Restart.AGE
        if rss > settings.max_rss:
            return Restart.RSS
        if settings.reload_stamp is not None and self._reloaded_since(process):
            return Restart.RELOAD
        return None

    def _reloaded_since(self, process: RunnerProcess) -> bool:
        assert self.settings.reload_stamp is not None
        try:
            touched = os.stat(self.settings.reload_stamp).st_mtime
        except OSError:
            return False
        return touched > process.born

    def _retire(self, process: RunnerProcess, cause: Restart | None) -> None:
        with self._lock:
            self._running.discard(process)
        self._end(process, cause)
        if cause is not None:
            self._replenish()

    def _replenish(self) -> None:
        """Start replacements (they boot meanwhile); one that cannot start is left to the
        next task's checkout, which says why."""
        try:
            self.warm()
        except RunnerBootError:
            log.debug("PHP runner replacement not started", exc_info=True)

    def _end(self, process: RunnerProcess, cause: Restart | None) -> None:
        process.stop()
        if cause is not None:
            log.info(
                "PHP runner %s replaced (%s) after %d task(s)",
                process.pid,
                cause.value,
                process.tasks,
            )
        for listener in self.listeners:
            listener.ended(process, cause)
