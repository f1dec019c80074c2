"""The consumers under test, started, checked, measured for CPU and stopped the same way:
process groups in roles, maybe per-task records; plus the plain Celery ceiling."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchkit import bridge_api, procs, rabbit, records
from benchkit.mariadb import PASSWORD, USER, Server
from benchkit.phorge import WebTier, web_tier
from benchkit.phorgedb import DATABASE
from benchkit.rabbit import Broker

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
    cycle: float = 1.0  # seconds between two looks at the queue when idle

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

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far by role, over each process's whole family."""
        table = procs.scan()
        return {
            role: sum(procs.family_cpu(p.pid, table) for p in group)
            for role, group in self.roles.items()
        }

    def stop(self) -> None:
        for p in self.procs():
            procs.stop(p, first_signal=self.stop_signal)

    def hooked(self, prefix: str, *path: Path) -> tuple[Path, dict[str, str]]:
        """A directory with ``records/`` and ``ready/``; a measured Python process's
        environment (``sitecustomize`` first on PYTHONPATH, no ``BRIDGE_*``)."""
        directory = Path(tempfile.mkdtemp(prefix=prefix, dir=self.scratch))
        self.records = directory / "records"
        for sub in ("records", "ready"):
            (directory / sub).mkdir()
        (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_")}
        env["PYTHONPATH"] = os.pathsep.join(map(str, (directory, *path, SCRIPTS)))
        env[records.RECORD_DIR] = str(self.records)
        env[records.READY_DIR] = str(directory / "ready")
        return directory, env

    def wait_ready(self, ready: Path, count: int) -> None:
        def all_ready() -> bool:
            return len(list(ready.iterdir())) >= count

        procs.wait_until(all_ready, timeout=90, what=f"{self.label} to be ready", check=self.check)


def bridge_settings(server: Server, broker: Broker, overrides: dict[str, str]) -> dict[str, str]:
    """The two URLs, queue names of their own on a shared vhost, then the overrides."""
    settings = {"BRIDGE_DATABASE_URL": server.url(DATABASE), "BRIDGE_BROKER_URL": broker.url}
    if broker.shared:
        suffix = secrets.token_hex(4)
        settings["BRIDGE_DEFAULT_QUEUE"] = f"bench-{suffix}"
        settings["BRIDGE_CONTROL_QUEUE"] = f"bench-control-{suffix}"
    return settings | overrides


@dataclass
class Bridge(Consumer):
    """``celery -A bridge beat`` plus ONE ``celery -A bridge worker -Q control,default``, or
    with ``beat_in_worker`` the README's one ``worker -B``; with ``web_root`` a web tier
    first, and the worker through Conduit to it."""

    server: Server | None = None
    broker: Broker | None = None
    overrides: dict[str, str] = field(default_factory=dict)
    pool: str = "prefork"
    concurrency: int = 1
    beat_in_worker: bool = False
    web_root: Path | None = None
    web_port: int = 0
    web: WebTier | None = None
    requests_at_release: int = 0  # web requests served when the batch was committed
    opcache: dict[str, object] = field(default_factory=dict)  # at the end

    def start(self) -> None:
        assert self.server and self.broker
        self.execute_name, self.poll_name = bridge_api.RUN_RECORD, bridge_api.POLL_TASK
        directory, env = self.hooked("bridge-", REPO)
        env[records.BRIDGE_RUNS] = "1"
        if self.web_root:
            self.web = web_tier(self.web_root, self.web_port, directory)
            self.roles["web-tier PHP"] = [self.web.proc]
            self.overrides = {**self.overrides, "BRIDGE_CONDUIT_URL": self.web.url}
        settings = bridge_settings(self.server, self.broker, self.overrides)
        env.update(settings)
        self.cycle = float(settings.get("BRIDGE_POLL_INTERVAL", bridge_api.DEFAULT_POLL_INTERVAL))
        celery = [sys.executable, "-m", "celery", "-A", bridge_api.CELERY_APP]
        consume = ["-B"]
        if not self.beat_in_worker:
            beat = [*celery, *f"beat -l WARNING --schedule {directory}/beat-schedule".split()]
            log = directory / "beat.log"
            self.roles["beat"] = [procs.start("beat", beat, env=env, cwd=REPO, log=log)]
            control = settings.get("BRIDGE_CONTROL_QUEUE", "bridge.control")
            consume = ["-Q", f"{control},{settings.get('BRIDGE_DEFAULT_QUEUE', 'phorge')}"]
        node = f"bench-{secrets.token_hex(3)}@%h"
        options = f"-c {self.concurrency} -P {self.pool} -n {node} -l WARNING".split()
        command, log = [*celery, "worker", *consume, *options], directory / "worker.log"
        self.roles["workers"] = [procs.start("worker", command, env=env, cwd=REPO, log=log)]
        self.wait_ready(directory / "ready", 1)

    def released(self) -> None:
        self.requests_at_release = self.web.accepted() if self.web else 0

    def cpu(self) -> dict[str, float]:
        """By role, and in the worker's family PHP as ``runner PHP`` and the beat ``-B``
        forks (marked by the hook) as ``beat``."""
        table = procs.scan()
        assert self.records
        beats = {int(p.stem) for p in self.records.glob(f"*{records.BEAT_SUFFIX}")}
        found = {"workers": 0.0, "beat": 0.0, "runner PHP": 0.0}
        for role, group in self.roles.items():
            for leader in group:
                for p in procs.family(table, leader.pid):
                    mine = role
                    if role == "workers" and p.name.startswith("php"):
                        mine = "runner PHP"
                    elif role == "workers" and p.pid in beats - {leader.pid}:
                        mine = "beat"
                    found[mine] = found.get(mine, 0.0) + p.cpu
        return found

    def stop(self) -> None:
        """The bridge first, then the web tier (asked for its opcache figures first)."""
        try:
            if self.web and self.web.proc.alive():
                self.opcache = self.web.opcache()
        except Exception as exc:  # a report detail only
            self.opcache = {"error": str(exc)[:200]}
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
        self.roles["workers"] = []
        for n in range(self.processes):
            command = f"-m benchkit.taskmaster --port {self.server.port} --user {USER} --password "
            command += f"{PASSWORD} --database {DATABASE} --records {self.records}"
            command += f" --ready {directory}/ready/{n}"
            command, log = [sys.executable, *command.split()], directory / f"taskmaster-{n}.log"
            proc = procs.start(f"taskmaster-{n}", command, env=env, cwd=REPO, log=log)
            self.roles["workers"].append(proc)
        self.wait_ready(directory / "ready", self.processes)


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
        for n in range(self.processes):
            log = directory / f"phd-{n}.log"
            self.roles.setdefault("workers", []).append(
                procs.start(f"phd-{n}", command, env=self.env, cwd=self.root, log=log)
            )


@dataclass
class SqlLoop(Consumer):
    """``bridge_api.sql_loop`` in a process of its own, unpaced (as a whole capacity's
    lease); released by a line on its stdin."""

    server: Server | None = None
    broker: Broker | None = None

    def start(self) -> None:
        assert self.server and self.broker
        self.execute_name = bridge_api.SQL_LOOP_RECORD
        directory, env = self.hooked("sqlloop-", REPO)
        env.update(bridge_settings(self.server, self.broker, {"BRIDGE_DISPATCH_AHEAD": "off"}))
        ready, log = f"{directory}/ready/loop", directory / "sqlloop.log"
        command = [sys.executable, "-m", "benchkit.records", ready, str(self.records)]
        proc = procs.start("sqlloop", command, env=env, cwd=REPO, log=log, stdin=subprocess.PIPE)
        self.roles["workers"] = [proc]
        self.wait_ready(directory / "ready", 1)

    def released(self) -> None:
        stdin = self.roles["workers"][0].popen.stdin
        assert stdin
        stdin.write(b"go\n")
        stdin.flush()

    def stop(self) -> None:
        for p in self.procs():
            if p.popen.stdin:
                p.popen.stdin.close()
        super().stop()


CELERY_APP = """\
import os
from celery import Celery

app = Celery("ceiling", broker=os.environ["BENCH_CEILING_BROKER"])
app.conf.update(task_ignore_result=True, task_acks_late=True, worker_prefetch_multiplier=1,
                worker_send_task_events=False, task_default_queue=os.environ["BENCH_CEILING_QUEUE"])


@app.task(name="ceiling.noop")
def noop(number):
    return None
"""


@dataclass
class CeilingResult:
    tasks: int
    seconds: float
    worker_cpu: float
    machine_busy: float
    others_busy: float  # the part of machine_busy no measured process explains

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds


def plain_celery(broker: Broker, scratch: Path, count: int, concurrency: int) -> CeilingResult:
    """Plain Celery on the same broker with the bridge's message settings (acks late,
    prefetch 1, no results, no events), no database: ``count`` no-op tasks sent by the
    bench, timed until the last one's end in the worker."""
    from celery import Celery

    consumer = Consumer("plain Celery", scratch)
    directory, env = consumer.hooked("celery-ceiling-")
    (directory / "ceiling_app.py").write_text(CELERY_APP)
    env["PYTHONPATH"] += os.pathsep + str(directory)
    queue = f"ceiling-{directory.name}"
    env.update(BENCH_CEILING_BROKER=broker.url, BENCH_CEILING_QUEUE=queue)
    command = f"-m celery -A ceiling_app worker -c {concurrency} -n {queue}@%h -l WARNING"
    command = [sys.executable, *command.split(), "--without-mingle", "--without-gossip"]
    worker = procs.start("celery", command, env=env, cwd=directory, log=directory / "worker.log")
    consumer.roles["workers"] = [worker]
    app = Celery("sender", broker=broker.url)
    app.conf.update(task_ignore_result=True, task_default_queue=queue)

    def send_and_wait(numbers: range) -> float:
        with app.producer_or_acquire() as producer:
            for number in numbers:
                app.send_task("ceiling.noop", args=(number,), producer=producer)
        ends: list[float] = []

        def done() -> bool:
            assert consumer.records
            found = records.read_records(consumer.records)
            ends[:] = [r.end for r in found if r.task_id in numbers]
            return len(ends) >= len(numbers)

        what = "the plain Celery worker"
        procs.wait_until(done, timeout=120, what=what, interval=0.02, check=consumer.check)
        return max(ends)

    try:
        consumer.wait_ready(directory / "ready", 1)
        send_and_wait(range(4 * concurrency))  # warm-up
        cpu, broker_cpu = consumer.cpu()["workers"], rabbit.cpu()
        machine = procs.MachineCPU.sample()
        bench, started = time.process_time(), time.time()
        end = send_and_wait(range(1_000_000, 1_000_000 + count))
        cpu, broker_cpu = consumer.cpu()["workers"] - cpu, rabbit.cpu() - broker_cpu
        known = cpu + broker_cpu + time.process_time() - bench
        shares = procs.MachineCPU.sample().shares(machine, known)
        return CeilingResult(count, end - started, cpu, *shares)
    finally:
        consumer.stop()
        with app.connection_for_write() as conn:  # leave the broker as found
            conn.default_channel.queue_delete(queue)
            conn.default_channel.exchange_delete(queue)
        app.close()
