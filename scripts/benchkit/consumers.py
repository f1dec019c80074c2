"""The consumers under test, started, checked, measured for CPU and stopped the same way:
process groups in roles, maybe per-task records."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchkit import bridge_api, procs, records
from benchkit.mariadb import Server
from benchkit.phorge import WebTier, web_tier
from benchkit.phorgedb import DATABASE

SCRIPTS = Path(__file__).resolve().parent.parent
REPO = SCRIPTS.parent
SITECUSTOMIZE = "from benchkit import records\n\nrecords.install()\n"


@dataclass
class Consumer:
    label: str
    scratch: Path
    records: Path | None = None  # per-task records, if the consumer writes them
    execute_name: str = ""  # the record name of one executed Phorge task
    poll_name: str | None = None  # the record name of a poll, when polls run in the workers
    roles: dict[str, list[procs.Proc]] = field(default_factory=dict)
    stop_signal: int = signal.SIGTERM

    def start(self) -> None:
        raise NotImplementedError

    def released(self) -> None:
        """Called right after a batch is committed."""

    def procs(self) -> list[procs.Proc]:
        return [p for group in self.roles.values() for p in group]

    def check(self) -> None:
        """Raise if any process has died (with the end of its log)."""
        for p in self.procs():
            if not p.alive():
                exited = f"{p.name} exited with {p.popen.returncode}"
                raise procs.BenchError(f"{self.label}: {exited}:\n{p.tail()}")

    def log_tails(self) -> str:
        return "".join(f"\n--- {p.name} ({p.log}):\n{p.tail(1500).strip()}" for p in self.procs())

    def role_of(self, role: str, leader: procs.Proc, p: procs.ProcStat) -> str:
        """The role whose CPU process ``p`` of ``leader``'s family counts in."""
        return role

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far by role, over each process's whole family."""
        table, found = procs.scan(), dict.fromkeys(self.roles, 0.0)
        for role, group in self.roles.items():
            for leader in group:
                for p in procs.family(table, leader.pid):
                    mine = self.role_of(role, leader, p)
                    found[mine] = found.get(mine, 0.0) + p.cpu
        return found

    def stop(self) -> None:
        for p in self.procs():
            procs.stop(p, first_signal=self.stop_signal)

    def hooked(self, prefix: str) -> tuple[Path, dict[str, str]]:
        """A directory with ``records/`` and ``ready/``; a measured Python process's
        environment (``sitecustomize`` first on PYTHONPATH, no ``BRIDGE_*``)."""
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=self.scratch))
        self.records = directory / "records"
        for sub in ("records", "ready"):
            (directory / sub).mkdir()
        (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_")}
        env["PYTHONPATH"] = os.pathsep.join(map(str, (directory, REPO, SCRIPTS)))
        env[records.RECORD_DIR] = str(self.records)
        env[records.READY_DIR] = str(directory / "ready")
        return directory, env

    def start_hooked(self, role: str, commands: list[list[str]], env: dict[str, str],
                     directory: Path, **kwargs: object) -> None:  # fmt: skip
        """Python ``commands`` in ``role``, returning once each has marked itself ready."""
        self.roles[role] = [
            procs.start(f"{role}-{n}", command, env=env, cwd=REPO,
                        log=directory / f"{role}-{n}.log", **kwargs)
            for n, command in enumerate(commands)
        ]  # fmt: skip

        def ready() -> bool:
            return len(list((directory / "ready").iterdir())) >= len(commands)

        procs.wait_until(ready, timeout=90, what=f"{self.label} to be ready", check=self.check)


@dataclass
class Bridge(Consumer):
    """``celery -A bridge beat`` plus ONE ``celery -A bridge worker -Q control,default``, or
    with ``beat_in_worker`` the README's one ``worker -B``; with ``web_root`` a web tier
    first, and the worker through Conduit to it."""

    server: Server | None = None
    broker: str = ""
    settings: dict[str, str] = field(default_factory=dict)
    pool: str = "prefork"
    concurrency: int = 1
    beat_in_worker: bool = False
    web_root: Path | None = None
    web: WebTier | None = None
    requests_at_release: int = 0  # web requests served when the batch was committed

    def start(self) -> None:
        assert self.server
        self.execute_name, self.poll_name = bridge_api.RUN_RECORD, bridge_api.POLL_TASK
        directory, env = self.hooked("bridge-")
        env[records.BRIDGE_RUNS] = "1"
        env |= {"BRIDGE_DATABASE_URL": self.server.url(DATABASE), "BRIDGE_BROKER_URL": self.broker}
        if self.web_root:
            self.web = web_tier(self.web_root, directory)
            self.roles["web-tier PHP"] = [self.web.proc]
            env["BRIDGE_CONDUIT_URL"] = self.web.url
        env |= self.settings
        celery = [sys.executable, "-m", "celery", "-A", bridge_api.CELERY_APP]
        consume = ["-B"]
        if not self.beat_in_worker:
            beat = [*celery, *f"beat -l WARNING --schedule {directory}/beat-schedule".split()]
            log = directory / "beat.log"
            self.roles["beat"] = [procs.start("beat", beat, env=env, cwd=REPO, log=log)]
            consume = ["-Q", "bridge.control,phorge"]
        node = f"bench-{secrets.token_hex(3)}@%h"
        options = f"-c {self.concurrency} -P {self.pool} -n {node} -l WARNING".split()
        self.start_hooked("workers", [[*celery, "worker", *consume, *options]], env, directory)

    def released(self) -> None:
        self.requests_at_release = self.web.accepted() if self.web else 0

    def role_of(self, role: str, leader: procs.Proc, p: procs.ProcStat) -> str:
        """In the worker's family, PHP as ``runner PHP`` and the ``-B`` beat's fork (marked
        by the hook) as ``beat``."""
        if role == "workers" and p.name.startswith("php"):
            return "runner PHP"
        assert self.records
        if role == "workers" and p.pid != leader.pid:
            return "beat" if (self.records / f"{p.pid}{records.BEAT_SUFFIX}").exists() else role
        return role

    def stop(self) -> None:
        """The bridge first, then the web tier its tasks call."""
        for role in ("workers", "beat", "web-tier PHP"):
            for p in self.roles.get(role, []):
                procs.stop(p)


@dataclass
class ReferenceTaskmaster(Consumer):
    """``processes`` x ``python3 -m benchkit.taskmaster``: Phorge's loop, in Python."""

    server: Server | None = None
    processes: int = 1

    def start(self) -> None:
        assert self.server
        self.execute_name = "taskmaster"
        directory, env = self.hooked("taskmaster-")
        command = [sys.executable, "-m", "benchkit.taskmaster", str(self.server.port)]
        commands = [[*command, str(self.records), f"{directory}/ready/{n}"]
                    for n in range(self.processes)]  # fmt: skip
        self.start_hooked("workers", commands, env, directory)


@dataclass
class Phd(Consumer):
    """``processes`` x ``bin/phd debug taskmaster`` of the copy. No records: its run ends
    when the bench sees the archive complete; ready once its warm-up batch is archived."""

    root: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    processes: int = 1

    def start(self) -> None:
        assert self.root
        self.stop_signal = signal.SIGKILL  # Phorge's CLI ignores SIGTERM
        directory = Path(tempfile.mkdtemp(prefix="phd-", dir=self.scratch))
        command = ["php", str(self.root / "bin" / "phd"), "debug", "taskmaster"]
        self.roles["workers"] = [
            procs.start(f"phd-{n}", command, env=self.env, cwd=self.root,
                        log=directory / f"phd-{n}.log") for n in range(self.processes)
        ]  # fmt: skip


@dataclass
class SqlLoop(Consumer):
    """``bridge_api.sql_loop`` in a process of its own, unpaced (as a whole capacity's
    lease); released by a line on its stdin, alive until stopped for its CPU to be read."""

    server: Server | None = None
    broker: str = ""

    def start(self) -> None:
        assert self.server
        self.execute_name = bridge_api.SQL_LOOP_RECORD
        directory, env = self.hooked("sqlloop-")
        env |= {"BRIDGE_DATABASE_URL": self.server.url(DATABASE), "BRIDGE_BROKER_URL": self.broker,
                "BRIDGE_DISPATCH_AHEAD": "off"}  # fmt: skip
        command = [sys.executable, "-m", "benchkit.bridge_api", f"{directory}/ready/loop"]
        command.append(str(self.records))
        self.start_hooked("workers", [command], env, directory, stdin=subprocess.PIPE)

    def released(self) -> None:
        stdin = self.roles["workers"][0].popen.stdin
        assert stdin
        stdin.write(b"go\n")
        stdin.flush()
