"""The bench's own MariaDB: durable, private, on 127.0.0.1, gone afterwards.

Started by the project's launcher (``scripts/mariadb_launcher.py``). Unlike the tests'
servers it keeps InnoDB's durability defaults (``innodb_flush_log_at_trx_commit=1``,
doublewrite on): a commit costs an fsync, as in production. Its only clients are the
measured consumers and the bench, which makes the server-wide status counters theirs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import MySQLdb
from mariadb_launcher import LaunchError, MariaDB

from benchkit import procs

USER, PASSWORD = "bench", "bench"
# Consecutive AUTO_INCREMENT ids for a multi-row INSERT, and room for every consumer.
FLAGS = ("--innodb-autoinc-lock-mode=1", "--max-connections=500")


@dataclass(frozen=True)
class Server:
    port: int
    proc: procs.Proc

    def connect(self) -> MySQLdb.Connection:
        """Over TCP, autocommit on, as every consumer connects."""
        conn = MySQLdb.connect(
            host="127.0.0.1", port=self.port, user=USER, password=PASSWORD, charset="utf8mb4"
        )
        conn.autocommit(True)
        return conn

    def url(self, database: str) -> str:
        return f"mysql+mysqldb://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"


@contextmanager
def private_server(port: int, scratch: Path) -> Iterator[Server]:
    """A datadir under ``scratch``, mariadbd on ``port``; stopped and deleted afterwards."""
    run = Path(tempfile.mkdtemp(prefix="mariadb-", dir=scratch))
    server = MariaDB(
        run, port, durable=True, extra_flags=FLAGS, user=USER, password=PASSWORD, grant_option=True
    )
    try:
        try:
            server.install()
            proc = procs.start(
                "mariadbd",
                server.command(),
                env=dict(os.environ),
                cwd=run,
                log=run / "mariadbd.out",
            )
        except LaunchError as exc:
            raise procs.BenchError(str(exc)) from None
        try:
            server.wait_ready(60, alive=proc.alive)
            server.create_user()
            yield Server(port, proc)
        except LaunchError as exc:
            raise procs.BenchError(str(exc)) from None
        finally:
            procs.stop(proc, grace=60)
    finally:
        shutil.rmtree(run, ignore_errors=True)
