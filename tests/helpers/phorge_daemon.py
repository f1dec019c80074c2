"""The shipped ``PhorgeBridgeQueueDaemon`` and the canary options on a real Phorge, as the
PHORGE_ROOT tests that run it share them (``tests/phorge/test_queue_daemon.py`` and
``tests/helpers/canary_phorge.py``'s canary).

The two options (``phorge-bridge.canary`` and ``phorge-bridge.canary-state``) belong to
the whole install: a test changes them only while it holds the MariaDB lock
``phorge-bridge-test:canary-options`` (:func:`options_held`), and their ``config_entry``
rows are put back as they were found. The daemon runs under ``bin/phd debug`` and is
stopped with SIGKILL (Phorge's CLI ignores SIGTERM), or as the shipped systemd unit runs
it (:class:`Unit`).
"""

from __future__ import annotations

import configparser
import json
import os
import re
import secrets
import shlex
import signal
import string
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from phorge_env import Phorge, kill

from bridge.canary.weights import OPTION, STATE_OPTION

DAEMON = "PhorgeBridgeQueueDaemon"
UNIT = (
    Path(__file__).resolve().parents[2]
    / "deploy"
    / "systemd"
    / "phorge-bridge-queue-daemon@.service"
)
LOCK = "phorge-bridge-test:canary-options"
OPTIONS = (OPTION, STATE_OPTION)  # their config_entry rows restored as found


@dataclass
class CanaryLab:
    """The install under test: its helper script, its worker database, and the names of
    its config and daemon databases."""

    phorge: Phorge
    worker: sa.Engine  # {namespace}_worker
    config_db: str  # {namespace}_config
    daemon_db: str  # {namespace}_daemon
    work: Path

    def call(self, command: str, **args: Any) -> Any:
        return self.phorge.php(command, json.dumps(args))

    def sql(self, statement: str, **params: Any) -> list[sa.Row[Any]]:
        with self.worker.begin() as conn:
            result = conn.execute(sa.text(statement), params)
            return list(result) if result.returns_rows else []

    def set_option(self, key: str, value: Any) -> None:
        """As an operator does: ``bin/config set --database`` (before the daemon starts:
        a config transaction makes phd's overseer restart its daemons)."""
        done = self.phorge.bin("config", "set", "--database", key, json.dumps(value))
        assert done.returncode == 0, done.stdout + done.stderr

    def set_weights(self, weights: dict[str, Any]) -> None:
        self.set_option(OPTION, weights)

    def option_rows(self) -> list[sa.Row[Any]]:
        binds = ", ".join(f"'{key}'" for key in OPTIONS)
        return self.sql(
            f"SELECT configKey, value, isDeleted FROM `{self.config_db}`.config_entry"
            f" WHERE namespace = 'default' AND configKey IN ({binds})"
        )

    def forget_option(self, key: str) -> None:
        self.sql(
            f"DELETE FROM `{self.config_db}`.config_entry"
            " WHERE namespace = 'default' AND configKey = :key",
            key=key,
        )

    def write_option(self, key: str, raw: str, deleted: int = 0) -> None:
        """As the bridge writes an option: the config_entry row itself, no transaction row
        (so phd's overseer does not restart its daemons)."""
        alphabet = "abcdefghijklmnopqrstuvwxyz234567"
        phid = "PHID-CONF-" + "".join(secrets.choice(alphabet) for _ in range(20))
        self.sql(
            f"INSERT INTO `{self.config_db}`.config_entry"
            " (phid, namespace, configKey, value, isDeleted, dateCreated, dateModified)"
            " VALUES (:phid, 'default', :key, :value, :deleted, UNIX_TIMESTAMP(),"
            " UNIX_TIMESTAMP())"
            " ON DUPLICATE KEY UPDATE value = VALUES(value), isDeleted = VALUES(isDeleted),"
            " dateModified = VALUES(dateModified)",
            phid=phid,
            key=key,
            value=raw,
            deleted=deleted,
        )


@contextmanager
def options_held(lab: CanaryLab) -> Iterator[None]:
    """The canary options held for the block (the MariaDB lock), their rows put back as
    they were found afterwards."""
    with lab.worker.connect() as holder:
        got = holder.execute(sa.text("SELECT GET_LOCK(:n, 300)"), {"n": LOCK}).scalar()
        assert got == 1, f"another test run holds the MariaDB lock {LOCK}"
        saved = lab.option_rows()
        try:
            yield
        finally:
            for key in OPTIONS:
                lab.forget_option(key)
            for key, value, deleted in saved:
                lab.write_option(key, value, int(deleted))
            holder.execute(sa.text("SELECT RELEASE_LOCK(:n)"), {"n": LOCK})


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def worked_on(self) -> list[int]:
        """The task ids the daemon leased, in order (its ``Working on task N`` lines)."""
        return [int(n) for n in re.findall(r"Working on task (\d+) ", self.output())]


@contextmanager
def daemon(lab: CanaryLab) -> Iterator[Daemon]:
    """``bin/phd debug PhorgeBridgeQueueDaemon``, SIGKILLed afterwards (Phorge's CLI
    ignores SIGTERM); its daemon_log row marked exited, as phd would on a clean stop."""
    log = lab.work / f"phd-{secrets.token_hex(4)}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["php", str(lab.phorge.root / "bin" / "phd"), "debug", DAEMON],
            cwd=lab.phorge.root,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    running = Daemon(process, log)
    try:
        yield running
    finally:
        kill(process)
        overseer = re.search(r'overseer \(with PID "(\d+)"\)', running.output())
        if overseer:
            lab.sql(
                f"UPDATE `{lab.daemon_db}`.daemon_log SET status = 'exit'"
                " WHERE daemon = :daemon AND pid = :pid AND status = 'run'",
                daemon=DAEMON,
                pid=int(overseer.group(1)),
            )


@dataclass(frozen=True)
class Unit:
    """What systemd runs for the shipped unit (:data:`UNIT`): its command with
    ``PHORGE_ROOT`` set to the install under test, its standard input and its stop
    signal (not its ``User``: the tests run as whoever runs them)."""

    command: list[str]
    stdin: bytes
    stop_signal: signal.Signals

    @classmethod
    def read(cls, phorge_root: Path) -> Unit:
        parser = configparser.ConfigParser(interpolation=None)
        parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
        parser.read_string(UNIT.read_text())
        service = parser["Service"]
        env = dict(pair.split("=", 1) for pair in shlex.split(service["Environment"]))
        env["PHORGE_ROOT"] = str(phorge_root)
        command = [
            string.Template(word).substitute(env) for word in shlex.split(service["ExecStart"])
        ]
        stdin = (service["StandardInputText"] + "\n").encode()
        return cls(command, stdin, signal.Signals[service["KillSignal"]])


@dataclass
class UnitDaemon(Daemon):
    """The unit's processes: its shell (``process``, a session leader as systemd makes
    it) and the daemon the shell runs, which starts a session of its own."""

    unit: Unit

    def daemon_pid(self) -> int | None:
        """The daemon's pid, once the shell started it."""
        shell = self.process.pid
        children = Path(f"/proc/{shell}/task/{shell}/children")
        with suppress(FileNotFoundError):
            pids = children.read_text().split()
            return int(pids[0]) if pids else None
        return None

    def stop(self, signo: signal.Signals) -> None:
        """``signo`` to each of the unit's processes, as systemd sends its KillSignal to
        the unit's control group."""
        for pid in (self.daemon_pid(), self.process.pid):
            if pid is not None:
                with suppress(ProcessLookupError):
                    os.kill(pid, signo)


@contextmanager
def unit_daemon(lab: CanaryLab) -> Iterator[UnitDaemon]:
    """The daemon as the shipped unit runs it (outside phd's overseer, listing itself),
    its standard error in the log; each of its processes SIGKILLed afterwards."""
    unit = Unit.read(lab.phorge.root)
    log = lab.work / f"unit-{secrets.token_hex(4)}.log"
    with log.open("wb") as err:
        process = subprocess.Popen(
            unit.command,
            cwd=lab.phorge.root,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # as systemd starts a service: a session of its own
        )
    assert process.stdin is not None
    process.stdin.write(unit.stdin)
    process.stdin.close()
    running = UnitDaemon(process, log, unit)
    try:
        yield running
    finally:
        running.stop(signal.SIGKILL)
        process.wait()
