"""The bench's own MariaDB: durable, private, on 127.0.0.1, gone afterwards.

Started by the project's one launcher (``scripts/mariadb_launcher.py``), under the
bench's process supervision. Unlike the tests' servers it keeps InnoDB's durability
defaults (``innodb_flush_log_at_trx_commit=1``, doublewrite on): a commit costs an
fsync, as in production, and that is what separates a consumer that commits once per
task from one that commits more. Its only clients are the measured consumers and the
bench, which is what makes the server-wide status counters attributable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import MySQLdb
from mariadb_launcher import LaunchError, MariaDB

from benchkit import procs

USER, PASSWORD = "bench", "bench"
STARTUP_TIMEOUT = 60


@dataclass(frozen=True)
class Server:
    port: int
    proc: procs.Proc

    def connect(self) -> MySQLdb.Connection:
        """A client connection over TCP, as every consumer connects (autocommit on)."""
        conn = MySQLdb.connect(
            host="127.0.0.1", port=self.port, user=USER, password=PASSWORD, charset="utf8mb4"
        )
        conn.autocommit(True)
        return conn

    def url(self, database: str) -> str:
        """The SQLAlchemy URL the bridge is given."""
        return f"mysql+mysqldb://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"


# On top of the launcher's flags: the default ("consecutive") lock mode, so a multi-row
# INSERT gets consecutive AUTO_INCREMENT ids, and room for every measured consumer.
BENCH_FLAGS = ("--innodb-autoinc-lock-mode=1", "--max-connections=500")


def launcher(run: Path, port: int) -> MariaDB:
    """The project's launcher, set up for the bench: durable commits, user bench."""
    return MariaDB(
        run,
        port,
        durable=True,
        extra_flags=BENCH_FLAGS,
        user=USER,
        password=PASSWORD,
        grant_option=True,
    )


@contextmanager
def private_server(port: int, scratch: Path) -> Iterator[Server]:
    """Install a datadir under ``scratch``, run mariadbd on ``port``; stop and delete it."""
    run = Path(tempfile.mkdtemp(prefix="mariadb-", dir=scratch))
    server = launcher(run, port)
    try:
        _launch(server.install)
        proc = procs.start(
            "mariadbd", server.command(), env=dict(os.environ), cwd=run, log=run / "mariadbd.out"
        )
        try:
            _launch(lambda: server.wait_ready(STARTUP_TIMEOUT, alive=proc.alive))
            _launch(server.create_user)
            yield Server(port, proc)
        finally:
            procs.stop(proc, grace=60)
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _launch(step: Callable[[], None]) -> None:
    """One launcher step; its failure is the bench's (reported, not a traceback)."""
    try:
        step()
    except LaunchError as exc:
        raise procs.BenchError(str(exc)) from None
