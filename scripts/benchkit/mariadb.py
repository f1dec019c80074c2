"""The bench's own MariaDB (``scripts/mariadb_launcher.py``), private and gone afterwards:
durable, unlike the tests' (a commit costs an fsync, as in production), and with no client
but the consumers and the bench, so the server-wide status counters are theirs."""

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
        login = {"user": USER, "password": PASSWORD, "charset": "utf8mb4"}
        conn = MySQLdb.connect(host="127.0.0.1", port=self.port, **login)
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
    proc = None
    try:
        server.install()
        command, log = server.command(), run / "mariadbd.out"
        proc = procs.start("mariadbd", command, env=dict(os.environ), cwd=run, log=log)
        server.wait_ready(60, alive=proc.alive)
        server.create_user()
        yield Server(port, proc)
    except LaunchError as exc:
        raise procs.BenchError(str(exc)) from None
    finally:
        if proc:
            procs.stop(proc, grace=60)
        shutil.rmtree(run, ignore_errors=True)
