"""The bridge's processes in Phorge's Daemons console (``/daemon/``).

Phorge's console lists what runs its queue from ``{namespace}_daemon.daemon_log``. phd's
overseer writes a row per daemon at launch, refreshes the row's ``dateModified`` with
each heartbeat and marks it exited at a clean stop (PhabricatorDaemonEventListener). A
worker and a beat do the same here, as ``PhorgeBridgeWorker`` and ``PhorgeBridgeBeat``.
The console then shows them with their host, pid, user and launch time. When their
heartbeats stop, it calls them unknown (after 3 missed beats of its own 120 s) and then
dead, as it does its own daemons. The row's ``argv`` is rebuilt from what the process
serves, never its command line, which may carry a broker password.

The row is a courtesy to Phorge's screens, not part of running tasks. An account that
may not write the log (it needs ``INSERT, UPDATE`` on it) or a database without one
is logged once, and the process works on.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from celery.signals import worker_ready, worker_shutdown
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from bridge.config import Settings, current_settings
from bridge.queue import make_engine
from bridge.queue import statements as sql
from bridge.queue.schema import beside
from bridge.runtime.announce import consumed_queues

log = logging.getLogger(__name__)

WORKER, BEAT = "PhorgeBridgeWorker", "PhorgeBridgeBeat"
RUNNING, EXITED = "run", "exit"  # PhabricatorDaemonLog::STATUS_RUNNING, STATUS_EXITED
HEARTBEAT = 60.0  # seconds; half of phd's, so one lost beat never shows as unknown


class ConsoleEntry:
    """One process's row in Phorge's daemon log: listed at :meth:`start`, refreshed by
    :meth:`beat`, marked exited at :meth:`stop`."""

    def __init__(self, engine: Engine, database: str, daemon: str, argv: Sequence[str]) -> None:
        self.engine = engine
        self.database = database
        self.daemon_id = f"bridge-{uuid.uuid4().hex}"
        self.row = {
            "daemon": daemon,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "argv": json.dumps(list(argv)),
            "explicitArgv": json.dumps(list(argv)),
            "runningAsUser": getpass.getuser(),
            "daemonID": self.daemon_id,
        }
        self.listed = False
        self._failing = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_settings(
        cls, settings: Settings, daemon: str, argv: Sequence[str]
    ) -> ConsoleEntry | None:
        """The entry of this process, or None: ``BRIDGE_DAEMON_CONSOLE`` is off, or the
        worker database has no Phorge daemon database beside it (SQLite, a test's)."""
        if not settings.daemon_console or settings.database_url.startswith("sqlite"):
            return None
        # Its own engine, emptied after each beat: no connection is open when a prefork
        # pool forks, so no child inherits (and at its exit closes) this one's socket.
        engine = make_engine(settings.database_url, pool_size=1)
        database = beside(engine.url.database, "daemon")
        if database is None:
            engine.dispose()
            return None
        return cls(engine, database, daemon, argv)

    def beat(self, status: str = RUNNING) -> None:
        """List this process (the first time), or refresh its heartbeat and status."""
        try:
            with self.engine.begin() as conn:
                if self.listed:
                    conn.execute(sql.daemon_status(self.database, self.daemon_id, status))
                else:
                    conn.execute(sql.list_daemon(self.database, {**self.row, "status": status}))
            self.listed = True  # committed
        except Exception as exc:
            if not self._failing:
                cause = exc.orig if isinstance(exc, DBAPIError) else exc
                log.warning(
                    "Phorge's Daemons console: this process is not listed in %s.daemon_log "
                    "(it needs INSERT, UPDATE there; BRIDGE_DAEMON_CONSOLE=false stops "
                    "trying): %s",
                    self.database,
                    cause,
                )
            self._failing = True
        else:
            if self._failing:
                log.info("Phorge's Daemons console: this process is listed again")
            self._failing = False
        finally:
            self.engine.dispose()

    def start(self) -> None:
        """List the process now, and beat every ``HEARTBEAT`` s in a thread of its own."""
        self.beat()
        self._thread = threading.Thread(
            target=self._beat_until_stopped, name="daemon-console", daemon=True
        )
        self._thread.start()

    def _beat_until_stopped(self) -> None:
        while not self._stopped.wait(HEARTBEAT):
            self.beat()

    def stop(self) -> None:
        """A clean stop: the console shows the process as exited."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        if self.listed:
            self.beat(EXITED)


def worker_argv(consumer: Any) -> list[str]:
    """What a worker's row shows as its arguments: its node and the queues it consumes."""
    queues = ",".join(consumed_queues(consumer))
    return ["worker", "--hostname", str(consumer.hostname), "--queues", queues]


def install() -> None:
    """Each worker lists itself once ready, and shows as exited at its shutdown."""
    entries: list[ConsoleEntry] = []

    def listed(sender: Any = None, **_: Any) -> None:
        entry = ConsoleEntry.for_settings(current_settings(), WORKER, worker_argv(sender))
        if entry is not None:
            entry.start()
            entries.append(entry)

    def exited(**_: Any) -> None:
        while entries:
            entries.pop().stop()

    worker_ready.connect(listed, weak=False)
    worker_shutdown.connect(exited, weak=False)
