"""The acceptance harness: a bridge deployment under test, with real ``celery worker``
and ``celery beat`` processes (the acceptance suite's fixtures and the fault suite use it).

A :class:`Bridge` is one deployment under test: a MariaDB database holding Phorge's
tables, a real broker, ``BRIDGE_*`` settings with queue names unique to the test (so
concurrent runs on the same RabbitMQ or Redis never share a queue; on Redis it also
claims a database of its own, ``redis_databases``), and the processes it started. Every
process runs in its own process group, and the group is SIGKILLed at teardown whatever
the test did; the test's queues are deleted from the broker afterwards.

Workers also load ``tests/acceptance/recording_handlers.py`` through a throwaway
distribution whose entry points register it, as a third-party package would ship handlers.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kombu import Connection
from redis_databases import REDIS_DATABASES
from sqlalchemy import Engine, func, select

from bridge.queue import PhorgeQueue, make_engine
from bridge.queue.dialect import db_now
from bridge.queue.model import NewTask, TaskFilter
from bridge.queue.schema import worker_activetask as active
from bridge.queue.schema import worker_archivetask as archive
from bridge.queue.schema import worker_taskdata as taskdata

T = TypeVar("T")
B = TypeVar("B", bound="Bridge")
PLUGIN = Path(__file__).parents[1] / "acceptance" / "recording_handlers.py"
RUN_RECORD = Path(__file__).with_name("run_record.py")
READY_TIMEOUT = 30.0
LOG_TAIL = 40  # lines of each process log shown when a wait fails
POLL_SENT = "bridge.poll sent."  # beat's DEBUG line for each poll it sends


def write_plugin(
    directory: Path,
    handlers: Path = PLUGIN,
    entry_point: str = "RecordingTestWorker = recording_handlers:RecordingTestWorker",
    extra: tuple[Path, ...] = (),
    version: str = "0",
) -> Path:
    """A directory for PYTHONPATH: a handler module, what it imports, and a distribution
    of ``version`` registering it in ``phorge_bridge.handlers`` and naming the modules it
    installed, as a third-party package would."""
    directory.mkdir(parents=True, exist_ok=True)
    sources = (handlers, RUN_RECORD, *extra)
    for source in sources:
        shutil.copy(source, directory / source.name)
    dist = directory / f"{handlers.stem}-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {handlers.stem}\nVersion: {version}\n"
    )
    (dist / "entry_points.txt").write_text(f"[phorge_bridge.handlers]\n{entry_point}\n")
    (dist / "top_level.txt").write_text("".join(f"{source.stem}\n" for source in sources))
    return directory


def clean_environ() -> dict[str, str]:
    """This process's environment without any BRIDGE_ setting (test addresses stay)."""
    return {name: value for name, value in os.environ.items() if not name.startswith("BRIDGE_")}


# Seconds between polls that each start a ``phorge-bridge`` process (a Python that
# imports the bridge): polled ten times a second they starve the workers under test.
CLI_INTERVAL = 1.0


def wait_until(
    condition: Callable[[], T],
    timeout: float,
    what: str,
    *,
    interval: float = 0.1,
    diagnose: Callable[[], str] = lambda: "",
) -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{diagnose()}")
        time.sleep(interval)


def forget_redis_keys(client, suffix: str) -> None:
    """Remove what kombu keeps in Redis for names holding ``suffix``.

    Besides its queue lists, kombu records bindings (sets, shared ones such as
    ``celery.pidbox``'s included) and the messages of killed workers (``unacked``).
    """
    marker = suffix.encode()
    for key in client.scan_iter(match=f"*{suffix}*"):
        client.delete(key)
    for key in client.scan_iter(match="_kombu.binding*"):
        if client.type(key) == b"set":
            stale = [member for member in client.smembers(key) if marker in member]
            if stale:
                client.srem(key, *stale)
    stale = [tag for tag, message in client.hscan_iter("unacked") if marker in message]
    if stale:
        client.hdel("unacked", *stale)
        client.zrem("unacked_index", *stale)


@dataclass
class CeleryProcess:
    """A ``celery`` subprocess, leader of its own process group."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = LOG_TAIL) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def running(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the main process only (Celery's own shutdown handling)."""
        if self.running():
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group (main process, prefork children) and reap it."""
        with suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)


class Bridge:
    """One bridge deployment under test: its settings, database, broker queues, processes."""

    def __init__(
        self, directory: Path, database_url: str, broker_url: str, **settings: str
    ) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.suffix = secrets.token_hex(4)
        self.database_url = database_url
        self.redis_database: tuple[str, int] | None = None
        if broker_url.startswith("redis"):
            # A database of its own, claimed until stop(), keeps Redis' fanout (events,
            # pidbox) apart too.
            server = broker_url.rstrip("/")
            self.redis_database = (server, REDIS_DATABASES.claim(server))
            broker_url = f"{server}/{self.redis_database[1]}"
        self.broker_url = broker_url
        self.record_file = directory / "runs.jsonl"
        self.plugin_dir = write_plugin(directory / "plugin")
        self.settings = {
            "BRIDGE_DATABASE_URL": database_url,
            "BRIDGE_BROKER_URL": broker_url,
            "BRIDGE_DEFAULT_QUEUE": self.queue_name("phorge"),
            "BRIDGE_CONTROL_QUEUE": self.queue_name("control"),
            "BRIDGE_POLL_INTERVAL": "0.2",
            "BRIDGE_MAX_INFLIGHT": "200",
        }
        self.settings.update({f"BRIDGE_{name}": value for name, value in settings.items()})
        self.routed_queues: list[str] = []
        self.processes: list[CeleryProcess] = []
        self.stopped = False
        self.queue = PhorgeQueue(make_engine(database_url))

    # -- naming and settings -------------------------------------------------------------

    def queue_name(self, base: str) -> str:
        """A Celery queue name unique to this test."""
        return f"{base}-{self.suffix}"

    def route(self, **rules: str) -> None:
        """Set BRIDGE_ROUTES from ``class_glob=queue_base`` pairs (queue names made unique)."""
        self.routed_queues = [self.queue_name(queue) for queue in rules.values()]
        self.settings["BRIDGE_ROUTES"] = ",".join(
            f"{glob}={queue}" for glob, queue in zip(rules, self.routed_queues, strict=True)
        )

    @property
    def default_queue(self) -> str:
        return self.settings["BRIDGE_DEFAULT_QUEUE"]

    @property
    def control_queue(self) -> str:
        return self.settings["BRIDGE_CONTROL_QUEUE"]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``phorge-bridge ARGS`` with the deployment's settings, as an operator runs it."""
        return subprocess.run(
            [sys.executable, "-m", "bridge.cli", *args],
            env=self.environ("cli"),
            cwd=self.directory,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def doctor(self) -> dict[str, dict[str, str]]:
        """``phorge-bridge doctor --json``'s checks, by name."""
        return {c["name"]: c for c in json.loads(self.cli("doctor", "--json").stdout)["checks"]}

    def environ(self, worker_name: str) -> dict[str, str]:
        env = clean_environ()
        env.update(self.settings)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.plugin_dir), *filter(None, [env.get("PYTHONPATH")])]
        )
        env["PYTHONUNBUFFERED"] = "1"
        env["PHORGE_BRIDGE_TEST_WORKER"] = worker_name
        env["PHORGE_BRIDGE_TEST_RECORD_FILE"] = str(self.record_file)
        return env

    # -- processes ------------------------------------------------------------------------

    def _start(
        self, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> CeleryProcess:
        log_path = self.directory / f"{name}.log"
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "bridge", *args],
                cwd=self.directory,
                env={**self.environ(name), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        process = CeleryProcess(name, popen, log_path)
        self.processes.append(process)
        return process

    def node(self, name: str) -> str:
        return f"{name}-{self.suffix}@localhost"

    def worker(
        self,
        name: str,
        queues: list[str],
        *,
        concurrency: int = 1,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> CeleryProcess:
        """Start ``celery worker -Q queues`` (names as given), with ``env`` over the
        deployment's settings (one host's own, e.g. a broken PHP); see :meth:`wait_ready`."""
        return self._start(
            name,
            [
                "worker",
                "-n",
                self.node(name),
                "-Q",
                ",".join(queues),
                "-c",
                str(concurrency),
                "-l",
                "INFO",
                # Other test runs share the broker: no syncing with their workers.
                "--without-mingle",
                "--without-gossip",
                *extra,
            ],
            env,
        )

    def beat(
        self, name: str = "beat", *, schedule_file: bool = True, level: str = "INFO"
    ) -> CeleryProcess:
        """Start ``celery beat``, with a schedule file of its own unless ``schedule_file``
        is False (then as the README runs it, in the bridge's directory); at DEBUG, its
        log has a line for each poll sent (:data:`POLL_SENT`)."""
        schedule = ["-s", str(self.directory / f"{name}-schedule")] if schedule_file else []
        return self._start(name, ["beat", "-l", level, *schedule])

    def wait_ready(self, *workers: CeleryProcess) -> None:
        """Wait until each worker logged that it is ready to consume."""
        for process in workers:
            marker = f"{self.node(process.name)} ready."
            wait_until(
                lambda p=process, m=marker: m in p.log() or not p.running(),
                READY_TIMEOUT,
                f"worker {process.name} to be ready",
                diagnose=self.diagnose,
            )
            if not process.running():
                pytest.fail(f"worker {process.name} exited:\n{process.tail()}")

    def logs(self) -> str:
        return "\n".join(p.log() for p in self.processes)

    def diagnose(self) -> str:
        """What to show when a wait fails: the database's view and each process's log tail."""
        parts = [f"active: {self.count(active)}, archived: {self.count(archive)}"]
        parts += [
            f"  {t.label} {t.state.value} owner={t.lease_owner} failures={t.failure_count}"
            for t in self.queue.list(TaskFilter(active=True, limit=20))
        ]
        parts += [f"--- {p.name} (pid {p.pid}) ---\n{p.tail()}" for p in self.processes]
        return "\n".join(parts)

    def wait_until(
        self, condition: Callable[[], T], timeout: float, what: str, *, interval: float = 0.1
    ) -> T:
        """:func:`wait_until` with this deployment's diagnosis; a condition that starts a
        CLI process polls with ``interval=CLI_INTERVAL``."""
        return wait_until(condition, timeout, what, interval=interval, diagnose=self.diagnose)

    def stop(self) -> None:
        """Kill every process group, delete the test's queues, close the database pool."""
        if self.stopped:
            return
        self.stopped = True
        for process in self.processes:
            process.kill()
        self.delete_broker_queues()
        if self.redis_database is not None:
            REDIS_DATABASES.release(*self.redis_database)
        self.queue.engine.dispose()

    def delete_broker_queues(self) -> None:
        """Leave the broker as found: the test's queues, exchanges and Redis keys go."""
        names = {self.default_queue, self.control_queue, *self.routed_queues}
        try:
            with Connection(self.broker_url, connect_timeout=5) as conn:
                channel = conn.default_channel
                for name in names:
                    channel.queue_delete(name)
                    if not self.broker_url.startswith("redis"):
                        channel.exchange_delete(name)
                if self.broker_url.startswith("redis"):
                    forget_redis_keys(channel.client, self.suffix)
        except Exception as exc:  # cleanup is best effort; the names are unique anyway
            print(f"could not clean the broker up: {exc}", file=sys.stderr)

    # -- the database ----------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self.queue.engine

    def enqueue(self, task_class: str, data: Any = None, *, count: int = 1, **options) -> list[int]:
        """Queue ``count`` tasks of one class in one transaction; returns their ids."""
        return self.queue.enqueue_many([NewTask(task_class, data, **options)] * count)

    def corrupt_data(self, task_id: int, text: str) -> None:
        """Overwrite a task's data row with ``text`` (invalid JSON, say)."""
        with self.engine.begin() as conn:
            data_id = conn.execute(select(active.c.dataID).where(active.c.id == task_id)).scalar()
            conn.execute(taskdata.update().where(taskdata.c.id == data_id).values(data=text))

    def now(self) -> int:
        """The database's clock (the archive's and the guard's), in whole seconds."""
        with self.engine.connect() as conn:
            return int(conn.execute(select(db_now())).scalar_one())

    def count(self, table, *where) -> int:
        with self.engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(table).where(*where)).scalar()

    def rows(self, table: Any, ids: list[int] | None = None) -> dict[int, Any]:
        """``table``'s rows by id (only ``ids`` when given)."""
        query = select(table)
        if ids is not None:
            query = query.where(table.c.id.in_(ids))
        with self.engine.connect() as conn:
            return {row.id: row for row in conn.execute(query)}

    def archived(self, ids: list[int] | None = None) -> dict[int, Any]:
        """Archive rows by id (only ``ids`` when given)."""
        return self.rows(archive, ids)

    def active_rows(self, ids: list[int] | None = None) -> dict[int, Any]:
        return self.rows(active, ids)

    def wait_archived(self, ids: list[int], timeout: float = 60) -> dict[int, Any]:
        """Wait until every task of ``ids`` is archived; returns their archive rows."""
        self.wait_until(
            lambda: self.count(archive, archive.c.id.in_(ids)) == len(ids),
            timeout,
            f"{len(ids)} task(s) to be archived",
        )
        return self.archived(ids)

    def runs(self, event: str = "start") -> list[dict[str, Any]]:
        """The recording handler's lines of one kind, in the order they were written."""
        if not self.record_file.exists():
            return []
        lines = self.record_file.read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["event"] == event]

    def runs_of(self, task_id: int, event: str = "start") -> list[dict[str, Any]]:
        return [r for r in self.runs(event) if r["id"] == task_id]


@contextmanager
def deployments(directory: Path, kind: type[B]) -> Iterator[Callable[..., B]]:
    """``make(database_url, broker_url, **settings)`` building ``kind`` deployments in
    ``directory``, all stopped on the way out."""
    bridges: list[B] = []

    def make(database_url: str, broker_url: str, **settings: str) -> B:
        bridges.append(
            kind(directory / f"bridge{len(bridges)}", database_url, broker_url, **settings)
        )
        return bridges[-1]

    try:
        yield make
    finally:
        for bridge in bridges:
            bridge.stop()
