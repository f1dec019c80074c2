"""The bench's own MariaDB: durable, private, on 127.0.0.1, gone afterwards.

Unlike ``scripts/services.sh``'s test server it keeps InnoDB's durability defaults
(``innodb_flush_log_at_trx_commit=1``, doublewrite on): a commit costs an fsync, as in
production, and that is what separates a consumer that commits once per task from one
that commits more. Its only clients are the measured consumers and the bench, which is
what makes the server-wide status counters attributable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import MySQLdb

from benchkit import procs

USER, PASSWORD = "bench", "bench"
STARTUP_TIMEOUT = 60


@dataclass(frozen=True)
class Server:
    port: int
    socket: Path
    proc: procs.Proc

    def connect(self, database: str | None = None) -> MySQLdb.Connection:
        """A client connection over TCP, as every consumer connects (autocommit on)."""
        kwargs = {"db": database} if database else {}
        conn = MySQLdb.connect(
            host="127.0.0.1",
            port=self.port,
            user=USER,
            password=PASSWORD,
            charset="utf8mb4",
            **kwargs,
        )
        conn.autocommit(True)
        return conn

    def url(self, database: str) -> str:
        """The SQLAlchemy URL the bridge is given."""
        return f"mysql+mysqldb://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"


def server_flags(datadir: Path, run: Path, port: int) -> list[str]:
    """mariadbd's command line: Phorge's settings, durable commits, loopback only."""
    return [
        "--no-defaults",  # keep /etc/mysql out
        "--user=root",
        f"--datadir={datadir}",
        f"--socket={run / 'mysqld.sock'}",
        f"--pid-file={run / 'mysqld.pid'}",
        f"--log-error={run / 'mysqld.log'}",
        f"--port={port}",
        "--bind-address=127.0.0.1",
        "--skip-name-resolve",
        "--character-set-server=utf8mb4",
        "--collation-server=utf8mb4_bin",
        "--sql-mode=STRICT_ALL_TABLES",
        # Durable: these are the defaults, spelled out because services.sh turns them off.
        "--innodb-flush-log-at-trx-commit=1",
        "--innodb-doublewrite=ON",
        # The default ("consecutive"): a multi-row INSERT gets consecutive AUTO_INCREMENT ids.
        "--innodb-autoinc-lock-mode=1",
        "--max-connections=500",
    ]


@contextmanager
def private_server(port: int, scratch: Path) -> Iterator[Server]:
    """Install a datadir under ``scratch``, run mariadbd on ``port``; stop and delete it."""
    run = Path(tempfile.mkdtemp(prefix="mariadb-", dir=scratch))
    try:
        _install(run)
        proc = procs.start(
            "mariadbd",
            ["mariadbd", *server_flags(run / "data", run, port)],
            env=dict(os.environ),
            cwd=run,
            log=run / "mariadbd.out",
        )
        try:
            _wait_ready(proc, run, port)
            _create_user(run)
            yield Server(port, run / "mysqld.sock", proc)
        finally:
            procs.stop(proc, grace=60)
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _install(run: Path) -> None:
    done = subprocess.run(
        [
            "mariadb-install-db",
            "--no-defaults",
            "--user=root",
            f"--datadir={run / 'data'}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode:
        raise procs.BenchError(f"mariadb-install-db failed:\n{done.stdout}{done.stderr}")


def _wait_ready(proc: procs.Proc, run: Path, port: int) -> None:
    def check() -> None:
        if not proc.alive():
            log = (run / "mysqld.log").read_text(errors="replace")[-2000:]
            raise procs.BenchError(f"mariadbd on port {port} exited:\n{log}")

    def pinged() -> bool:
        ping = ["mariadb-admin", "--no-defaults", f"--socket={run / 'mysqld.sock'}", "-uroot"]
        return subprocess.run([*ping, "ping"], capture_output=True).returncode == 0

    procs.wait_until(pinged, timeout=STARTUP_TIMEOUT, what="mariadbd", interval=0.1, check=check)


def _create_user(run: Path) -> None:
    sql = (
        f"CREATE USER '{USER}'@'127.0.0.1' IDENTIFIED BY '{PASSWORD}';"
        f" GRANT ALL ON *.* TO '{USER}'@'127.0.0.1' WITH GRANT OPTION;"
    )
    subprocess.run(
        ["mariadb", "--no-defaults", f"--socket={run / 'mysqld.sock'}", "-uroot", "-e", sql],
        check=True,
        capture_output=True,
    )
