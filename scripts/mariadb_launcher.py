#!/usr/bin/env python3
"""The one way this project starts a MariaDB of its own: loopback only, Phorge's settings.

Three callers, one implementation:

- ``scripts/services.sh`` runs ``python3 scripts/mariadb_launcher.py start --dir D
  --port P`` for the tests' shared server (3307, user ``bridge``), which outlives the
  script; ``stop`` stays in services.sh, with the other services.
- The fault suite (``tests/faults/conftest.py``) starts, stops, kills and freezes a
  server of its own (:class:`MariaDB`, ``start`` returns the process).
- The bench (``scripts/benchkit/mariadb.py``) runs a durable one under its own process
  supervision (:meth:`MariaDB.command`, :meth:`MariaDB.wait_ready`).

The server settings are Phorge's (``utf8mb4_bin``, ``STRICT_ALL_TABLES``);
``--no-defaults`` keeps ``/etc/mysql`` out. The tests' servers trade durability for
speed (their data is thrown away); the bench keeps InnoDB's durable defaults, since a
commit's fsync is part of what it measures. Everything a server writes (``data/``,
``mysqld.sock``, ``mysqld.pid``, ``mysqld.log``) lives in its directory.

Only the standard library: services.sh runs this before the project is installed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Durability traded for speed: no flush per commit, no doublewrite buffer.
FAST_FLAGS = ("--innodb-flush-log-at-trx-commit=0", "--skip-innodb-doublewrite")
# InnoDB's defaults, spelled out because the fast flags turn them off.
DURABLE_FLAGS = ("--innodb-flush-log-at-trx-commit=1", "--innodb-doublewrite=ON")
INSTALL_TIMEOUT = 120.0
START_TIMEOUT = 60.0


class LaunchError(RuntimeError):
    """The server could not be installed or did not come up; the message says why."""


@dataclass
class MariaDB:
    """One private ``mariadbd``: where it keeps its state, its port, its flags, its user."""

    directory: Path
    port: int
    durable: bool = False
    extra_flags: Sequence[str] = ()  # appended to the command line (the bench's limits)
    user: str = "bridge"
    password: str = "bridge"
    grant_option: bool = False

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)

    @property
    def datadir(self) -> Path:
        return self.directory / "data"

    @property
    def socket(self) -> Path:
        return self.directory / "mysqld.sock"

    @property
    def pidfile(self) -> Path:
        return self.directory / "mysqld.pid"

    @property
    def logfile(self) -> Path:
        return self.directory / "mysqld.log"

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the server (no database), as its user over TCP."""
        return f"mysql+mysqldb://{self.user}:{self.password}@127.0.0.1:{self.port}"

    def flags(self) -> list[str]:
        """mariadbd's options: Phorge's settings, loopback only, state in the directory."""
        return [
            "--no-defaults",
            "--user=root",
            f"--datadir={self.datadir}",
            f"--socket={self.socket}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            "--skip-name-resolve",
            f"--pid-file={self.pidfile}",
            f"--log-error={self.logfile}",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_bin",
            "--sql-mode=STRICT_ALL_TABLES",
            *(DURABLE_FLAGS if self.durable else FAST_FLAGS),
            *self.extra_flags,
        ]

    def command(self) -> list[str]:
        return ["mariadbd", *self.flags()]

    def install(self, timeout: float = INSTALL_TIMEOUT) -> None:
        """A fresh system database in ``data/`` (root logs in over the socket)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={self.datadir}",
             "--auth-root-authentication-method=normal", "--skip-test-db"],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        output = done.stdout + done.stderr
        (self.directory / "install.log").write_text(output)
        if done.returncode:
            raise LaunchError(f"mariadb-install-db failed:\n{output[-3000:]}")

    def spawn(self) -> subprocess.Popen:
        """Run mariadbd in a session of its own, its output in ``mysqld.log`` only."""
        return subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def ping(self) -> bool:
        """Whether the server answers root on its socket."""
        command = ["mariadb-admin", "--no-defaults", f"--socket={self.socket}", "-uroot", "ping"]
        try:
            done = subprocess.run(command, capture_output=True, timeout=10, check=False)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def wait_ready(
        self, timeout: float = START_TIMEOUT, alive: Callable[[], bool] | None = None
    ) -> None:
        """Poll until the server answers; ``alive`` returning False fails at once."""
        deadline = time.monotonic() + timeout
        while not self.ping():
            if alive is not None and not alive():
                raise LaunchError(f"mariadbd on port {self.port} exited:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"mariadbd on 127.0.0.1:{self.port} did not answer within {timeout:.0f} s:"
                    f"\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def create_user(self) -> None:
        """The server's one user, over TCP from 127.0.0.1, with every privilege."""
        account = f"'{self.user}'@'127.0.0.1'"
        grant = " WITH GRANT OPTION" if self.grant_option else ""
        sql = (
            f"CREATE USER IF NOT EXISTS {account} IDENTIFIED BY '{self.password}';"
            f" GRANT ALL ON *.* TO {account}{grant};"
        )
        done = subprocess.run(
            ["mariadb", "--no-defaults", f"--socket={self.socket}", "-uroot", "-e", sql],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if done.returncode:
            raise LaunchError(f"creating user {self.user} failed:\n{done.stdout}{done.stderr}")

    def start(self, timeout: float = START_TIMEOUT) -> subprocess.Popen:
        """Spawn the server (installed already), wait until it answers, create the user."""
        popen = self.spawn()
        try:
            self.wait_ready(timeout, alive=lambda: popen.poll() is None)
            self.create_user()
        except BaseException:
            popen.kill()
            popen.wait()
            raise
        return popen

    def running(self) -> bool:
        """Whether the pid file names a live process (a zombie counts as gone)."""
        try:
            pid = int(self.pidfile.read_text())
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (OSError, ValueError):
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return f"(no {self.logfile})"


def start_detached(server: MariaDB, timeout: float) -> None:
    """services.sh's start: a fresh directory unless a server is already starting in it;
    the server outlives this process (services.sh stops it by its pid file)."""
    popen: Any = None
    if not server.running():
        # A fresh datadir every time: nothing leaks from one run into the next.
        shutil.rmtree(server.directory, ignore_errors=True)
        server.install()
        popen = server.spawn()
    server.wait_ready(timeout, alive=None if popen is None else lambda: popen.poll() is None)
    server.create_user()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start a server that outlives this process")
    start.add_argument("--dir", type=Path, required=True, help="the server's state directory")
    start.add_argument("--port", type=int, required=True)
    start.add_argument("--timeout", type=float, default=START_TIMEOUT, help="seconds to come up")
    start.add_argument("--durable", action="store_true", help="keep InnoDB's durable defaults")
    start.add_argument("--user", default="bridge")
    start.add_argument("--password", default="bridge")
    start.add_argument(
        "--grant-option", action="store_true", help="let the user create accounts (tests do)"
    )
    args = parser.parse_args(argv)
    server = MariaDB(
        args.dir,
        args.port,
        args.durable,
        user=args.user,
        password=args.password,
        grant_option=args.grant_option,
    )
    try:
        start_detached(server, args.timeout)
    except (LaunchError, OSError, subprocess.SubprocessError) as exc:
        print(f"mariadb_launcher: ERROR: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
