"""The two ceilings the bridge cannot pass: plain Celery, and the bridge's SQL without Celery.

- Plain Celery: a throwaway app (written into a temporary directory) with a no-op task,
  on the same RabbitMQ, with the bridge's message settings (acks late, prefetch 1, no
  results, no events), one ``worker -c 4``; the bench sends the tasks itself.
- The SQL path: ``benchkit.sqlloop`` in a process of its own, with the bridge's default
  settings, measured by the same ``Runner`` as every consumer.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from celery import Celery

from benchkit import procs, rabbit
from benchkit.consumers import REPO, Consumer, bridge_settings, hooked_env, wait_ready_files
from benchkit.mariadb import Server
from benchkit.rabbit import Broker
from benchkit.records import read_records
from benchkit.sqlloop import RECORD_NAME

CELERY_APP = '''\
"""Plain Celery, no database: the broker and Celery's own cost per task."""

import os

from celery import Celery

app = Celery("ceiling", broker=os.environ["BENCH_CEILING_BROKER"])
app.conf.update(
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    worker_send_task_events=False,
    task_default_queue=os.environ["BENCH_CEILING_QUEUE"],
)


@app.task(name="ceiling.noop")
def noop(number):
    return None
'''
CELERY_TASK = "ceiling.noop"
CELERY_SETTINGS = "acks late, prefetch 1, no results, no events"


@dataclass
class CeilingResult:
    tasks: int
    seconds: float
    worker_cpu: float
    machine_busy: float
    others_busy: float  # the part of machine_busy no measured process explains
    settings: str

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds


def plain_celery(broker: Broker, scratch: Path, count: int, concurrency: int) -> CeilingResult:
    """Send ``count`` no-op tasks, time them until the last one finished in the worker."""
    directory = Path(tempfile.mkdtemp(prefix="celery-ceiling-", dir=scratch))
    (directory / "ceiling_app.py").write_text(CELERY_APP)
    env = hooked_env(directory, [directory])
    queue = f"ceiling-{directory.name}"
    env.update(BENCH_CEILING_BROKER=broker.url, BENCH_CEILING_QUEUE=queue)
    consumer = Consumer(label="plain Celery", scratch=scratch, records=directory / "records")
    worker = procs.start(
        "celery-ceiling",
        [
            *(sys.executable, "-m", "celery", "-A", "ceiling_app", "worker"),
            *("-c", str(concurrency), "-n", f"{queue}@%h", "-l", "WARNING"),
            *("--without-mingle", "--without-gossip"),
        ],
        env=env,
        cwd=directory,
        log=directory / "worker.log",
    )
    consumer.roles["workers"] = [worker]
    app = _sender_app(broker, queue)
    try:
        wait_ready_files(consumer, directory / "ready", 1)
        _send_and_wait(app, consumer, range(0, 4 * concurrency))  # warm-up
        return _measure(app, consumer, count)
    finally:
        consumer.stop()
        _delete_queue(app, queue)
        app.close()


def _measure(app: Celery, consumer: Consumer, count: int) -> CeilingResult:
    cpu_before, machine_before = consumer.cpu(), procs.MachineCPU.sample()
    broker_pid = rabbit.rabbitmq_pid()
    broker_before = procs.process_cpu(broker_pid) if broker_pid else 0.0
    bench_before, started = time.process_time(), time.time()
    end = _send_and_wait(app, consumer, range(1_000_000, 1_000_000 + count))
    cpu = consumer.cpu()["workers"] - cpu_before["workers"]
    machine = procs.MachineCPU.sample()
    broker = (procs.process_cpu(broker_pid) if broker_pid else 0.0) - broker_before
    known = cpu + broker + time.process_time() - bench_before
    busy = machine.busy_share_since(machine_before)
    others = max(0.0, busy - known / machine.capacity_since(machine_before))
    return CeilingResult(count, end - started, cpu, busy, others, CELERY_SETTINGS)


def _delete_queue(app: Celery, queue: str) -> None:
    """Leave the broker as found (matters only on the shared default vhost)."""
    with app.connection_for_write() as conn:
        conn.default_channel.queue_delete(queue)
        conn.default_channel.exchange_delete(queue)


def _sender_app(broker: Broker, queue: str) -> Celery:
    """The bench's side: sends by name, so it needs no copy of the task."""
    app = Celery("ceiling-sender", broker=broker.url)
    app.conf.update(task_ignore_result=True, task_default_queue=queue)
    return app


def _send_and_wait(app: Celery, consumer: Consumer, numbers: range) -> float:
    """Send one task per number; return when the last one finished (its record's end)."""
    with app.producer_or_acquire() as producer:
        for number in numbers:
            app.send_task(CELERY_TASK, args=(number,), producer=producer)
    wanted = set(numbers)
    found: list[float] = []

    def done() -> bool:
        assert consumer.records is not None
        records = [r for r in read_records(consumer.records) if r.task_id in wanted]
        found[:] = [r.end for r in records]
        return len(records) >= len(wanted)

    procs.wait_until(
        done, timeout=120, what="the plain Celery worker", interval=0.02, check=consumer.check
    )
    return max(found)


@dataclass
class SqlLoop(Consumer):
    """``benchkit.sqlloop`` with the bridge's default settings; released by a stdin line."""

    server: Server | None = None
    broker: Broker | None = None

    def start(self) -> None:
        assert self.server is not None and self.broker is not None
        self.execute_name = RECORD_NAME
        directory = self.workdir("sqlloop-")
        env = hooked_env(directory, [REPO])
        env.update(bridge_settings(self.server, self.broker, {}))
        command = [
            sys.executable, "-m", "benchkit.sqlloop",
            "--ready", str(directory / "ready" / "loop"), "--records", str(self.records),
        ]  # fmt: skip
        proc = procs.start(
            "sqlloop", command, env=env, cwd=REPO, log=directory / "sqlloop.log",
            stdin=subprocess.PIPE,
        )  # fmt: skip
        self.roles["workers"] = [proc]
        wait_ready_files(self, directory / "ready", 1)

    def released(self) -> None:
        """The batch is committed: go."""
        stdin = self.roles["workers"][0].popen.stdin
        assert stdin is not None
        stdin.write(b"go\n")
        stdin.flush()

    def stop(self) -> None:
        for proc in self.procs():
            if proc.popen.stdin:
                proc.popen.stdin.close()
        super().stop()
