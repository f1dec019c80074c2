"""The consumers under test, each started, checked and stopped the same way.

A consumer is a set of process groups in roles ("workers", "beat"), an optional
directory of per-task records (``records``), and the name its records give an executed
Phorge task. ``start`` returns once it is ready by a condition (a ready file), never
after a fixed sleep; the runner then proves it works with a warm-up batch.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchkit import bridge_api, hook, procs, rabbit
from benchkit.mariadb import PASSWORD, USER, Server
from benchkit.phorgedb import DATABASE
from benchkit.rabbit import Broker

READY_TIMEOUT = 90
SCRIPTS = Path(__file__).resolve().parent.parent
REPO = SCRIPTS.parent
SITECUSTOMIZE = "from benchkit import hook\n\nhook.install()\n"


@dataclass
class Consumer:
    """Processes under test; subclasses say how to start them."""

    label: str
    scratch: Path
    records: Path | None = None  # per-task records, if the consumer writes them
    execute_name: str = ""  # the record name of one executed Phorge task
    poll_name: str | None = None  # the record name of a poll, if polls run in the workers
    roles: dict[str, list[procs.Proc]] = field(default_factory=dict)
    stop_signal: int = signal.SIGTERM
    cycle: float = 1.0  # seconds between two looks at the queue when idle

    def start(self) -> None:
        raise NotImplementedError

    def released(self) -> None:
        """Called right after a batch is committed (only the SQL loop waits for it)."""

    def procs(self) -> list[procs.Proc]:
        return [p for group in self.roles.values() for p in group]

    def check(self) -> None:
        """Raise if any process has died (with the end of its log)."""
        for proc in self.procs():
            if not proc.alive():
                raise procs.BenchError(
                    f"{self.label}: {proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}"
                )

    def diagnose(self) -> str:
        """Extra state worth showing when a run fails (the Bridge: its broker queues)."""
        return ""

    def log_tails(self, chars: int = 1500) -> str:
        """The end of every process's output, for a failure report."""
        tails = [f"\n--- {p.name} ({p.log}):\n{p.tail(chars).strip()}" for p in self.procs()]
        return "".join(tails)

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far per role: every process of the role's families (its
        sessions, and descendants that left them, as phd's daemon does)."""
        table = procs.scan()
        return {
            role: sum(procs.family_cpu(p.pid, table) for p in group)
            for role, group in self.roles.items()
        }

    def stop(self) -> None:
        for proc in self.procs():
            procs.stop(proc, first_signal=self.stop_signal)

    def workdir(self, prefix: str) -> Path:
        """A new directory for this start, with ``records/`` and ``ready/`` in it."""
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=self.scratch))
        self.records = directory / "records"
        self.records.mkdir()
        (directory / "ready").mkdir()
        return directory


def hooked_env(directory: Path, extra_path: list[Path]) -> dict[str, str]:
    """The environment of a hooked Python process: sitecustomize first on PYTHONPATH."""
    for sub in ("records", "ready"):
        (directory / sub).mkdir(exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_")}
    path = [directory, *extra_path, SCRIPTS]
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in path)
    env[hook.RECORD_DIR_ENV] = str(directory / "records")
    env[hook.READY_DIR_ENV] = str(directory / "ready")
    return env


def bridge_settings(
    server: Server, broker: Broker, overrides: dict[str, str], own_queues: bool = False
) -> dict[str, str]:
    """``BRIDGE_*`` for one deployment: the two URLs, then the overrides.

    On a shared vhost (no private one could be made), or when told (a run that stops with
    messages queued), the queues get names of their own.
    """
    settings = {
        "BRIDGE_DATABASE_URL": server.url(DATABASE),
        "BRIDGE_BROKER_URL": broker.url,
    }
    if broker.vhost is None or own_queues:
        suffix = secrets.token_hex(4)
        settings["BRIDGE_DEFAULT_QUEUE"] = f"bench-{suffix}"
        settings["BRIDGE_CONTROL_QUEUE"] = f"bench-control-{suffix}"
    settings.update(overrides)
    return settings


def wait_ready_files(consumer: Consumer, ready: Path, count: int) -> None:
    procs.wait_until(
        lambda: len(list(ready.iterdir())) >= count,
        timeout=READY_TIMEOUT,
        what=f"{consumer.label} to be ready",
        check=consumer.check,
    )


@dataclass
class Bridge(Consumer):
    """``celery -A bridge beat`` plus ONE ``celery -A bridge worker -Q control,default``,
    or with ``beat_in_worker`` the README's one ``celery -A bridge worker -B``."""

    server: Server | None = None
    broker: Broker | None = None
    overrides: dict[str, str] = field(default_factory=dict)
    pool: str = "prefork"
    concurrency: int = 1
    beat_in_worker: bool = False
    own_queues: bool = False

    def start(self) -> None:
        assert self.server is not None and self.broker is not None
        self.execute_name, self.poll_name = bridge_api.RUN_RECORD, bridge_api.POLL_TASK
        directory = self.workdir("bridge-")
        env = hooked_env(directory, [REPO])
        env[hook.BRIDGE_RUNS_ENV] = "1"
        settings = bridge_settings(self.server, self.broker, self.overrides, self.own_queues)
        env.update(settings)
        interval = settings.get("BRIDGE_POLL_INTERVAL", bridge_api.DEFAULT_POLL_INTERVAL)
        self.cycle = float(interval)
        celery = [sys.executable, "-m", "celery", "-A", bridge_api.CELERY_APP]
        if self.beat_in_worker:
            consume = ["-B"]  # and every queue the bridge declares: control and default
        else:
            beat = procs.start(
                "beat",
                [*celery, "beat", "-l", "WARNING", "--schedule", str(directory / "beat-schedule")],
                env=env,
                cwd=REPO,
                log=directory / "beat.log",
            )
            self.roles["beat"] = [beat]
            queues = ",".join(
                (
                    settings.get("BRIDGE_CONTROL_QUEUE", "bridge.control"),
                    settings.get("BRIDGE_DEFAULT_QUEUE", "phorge"),
                )
            )
            consume = ["-Q", queues]
        node = f"bench-{secrets.token_hex(3)}@%h"
        pool = ["-P", self.pool] if self.pool != "prefork" else []
        options = ["-c", str(self.concurrency), *pool, "-n", node, "-l", "WARNING"]
        worker = procs.start(
            "worker",
            [*celery, "worker", *consume, *options],
            env=env,
            cwd=REPO,
            log=directory / "worker.log",
        )
        self.roles["workers"] = [worker]
        wait_ready_files(self, directory / "ready", 1)

    def diagnose(self) -> str:
        if self.broker is None or self.broker.vhost is None:
            return ""
        depths = rabbit.queue_depths(self.broker.vhost)
        return f"\n--- broker queues (name, ready, unacked, consumers):\n{depths}"


@dataclass
class ReferenceTaskmaster(Consumer):
    """``processes`` times ``python3 -m benchkit.taskmaster`` (Phorge's loop, in Python)."""

    server: Server | None = None
    processes: int = 1

    def start(self) -> None:
        assert self.server is not None
        self.execute_name = "taskmaster"
        directory = self.workdir("taskmaster-")
        env = hooked_env(directory, [])
        group = []
        for n in range(self.processes):
            command = [
                sys.executable, "-m", "benchkit.taskmaster", "--port", str(self.server.port),
                "--user", USER, "--password", PASSWORD, "--database", DATABASE,
                "--records", str(self.records), "--ready", str(directory / "ready" / str(n)),
            ]  # fmt: skip
            log = directory / f"taskmaster-{n}.log"
            group.append(procs.start(f"taskmaster-{n}", command, env=env, cwd=REPO, log=log))
        self.roles["workers"] = group
        wait_ready_files(self, directory / "ready", self.processes)


@dataclass
class Phd(Consumer):
    """``processes`` times ``bin/phd debug taskmaster`` of a real Phorge (see ``phorge``).

    phd writes no records: its throughput ends when the bench sees the archive complete,
    and its latency is enqueue to archive as seen by polling.
    """

    phorge_root: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    processes: int = 1

    def start(self) -> None:
        assert self.phorge_root is not None
        self.stop_signal = signal.SIGKILL  # Phorge's CLI ignores SIGTERM
        self.records = None
        directory = Path(tempfile.mkdtemp(prefix="phd-", dir=self.scratch))
        group = []
        for n in range(self.processes):
            command = ["php", str(self.phorge_root / "bin" / "phd"), "debug", "taskmaster"]
            log = directory / f"phd-{n}.log"
            group.append(
                procs.start(f"phd-{n}", command, env=self.env, cwd=self.phorge_root, log=log)
            )
        self.roles["workers"] = group
        # Ready when it runs a task: the runner's warm-up batch is the condition.
