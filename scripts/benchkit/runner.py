"""One measured run, the same for every consumer, so that their figures compare: all tasks
enqueued in one transaction, timed from its COMMIT to the last archive (the consumer's
record of it, else when the bench saw it: phd, polled every 10 ms); CPU and MariaDB's
counters before and after, the bench's own requests left out. Plain Celery's ceiling is
timed alike, from its first send."""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import MySQLdb

from benchkit import phorgedb, procs, rabbit
from benchkit.consumers import Consumer
from benchkit.phorgedb import Batch
from benchkit.records import Counters, Record, counters_between, read_records

STALL_TIMEOUT = 30.0  # a run fails when nothing is archived for this long


@dataclass(frozen=True)
class Workload:
    key: str  # in scenario names
    label: str
    data: str | tuple[str, ...]  # every task's JSON, or JSONs the tasks take in turn
    task_class: str = phorgedb.TASK_CLASS


NOOP = Workload("noop", "no-op", "{}")
SLEEP10 = Workload("10ms", "10 ms sleep", '{"duration":0.01}')
IO50 = Workload("io50", "50 ms I/O-bound", '{"duration":0.05}')


@dataclass
class Throughput:
    tasks: int
    seconds: float  # from the enqueue COMMIT to the last archive
    first_start: float  # from the enqueue COMMIT to the first start
    cpu: dict[str, float]  # role -> CPU seconds
    broker_cpu: float
    machine_cpu: float  # CPU seconds the machine was busy, whoever used them
    machine_busy: float  # 0..1 of all cores
    others_busy: float  # 0..1 of all cores, not explained by any measured process
    db_cpu: float | None = None
    client: Counters | None = None  # None: the consumer records no counters (phd)
    server: dict[str, int] = field(default_factory=dict)  # MariaDB's, the bench's left out
    poll_cpu: float | None = None  # of which the bridge's polls, when they run in its workers
    problems: list[str] = field(default_factory=list)
    web_requests: int | None = None  # the Conduit web tier's, for the drain

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds if self.seconds > 0 else float("nan")

    @property
    def steady_rate(self) -> float | None:
        """Tasks/s from the first start (without phd's idle sleep or the poll before it)."""
        running = self.seconds - self.first_start
        return self.tasks / running if running > 0 else None

    def per_task(self, seconds: float | None) -> float | None:
        return None if seconds is None else seconds / self.tasks


class Sample(NamedTuple):
    cpu: dict[str, float]
    db: float
    broker: float
    machine: procs.MachineCPU
    bench: float
    status: phorgedb.Status

    def known_since(self, before: Sample) -> float:
        """CPU seconds of every measured process since ``before``, the bench's included."""
        cpu = sum(self.cpu.values()) - sum(before.cpu.values())
        return cpu + self.db - before.db + self.broker - before.broker + self.bench - before.bench


class Runner:
    """Drives runs on the bench's own connection."""

    def __init__(self, conn: MySQLdb.Connection, db_pid: int) -> None:
        self.conn, self.db_pid = conn, db_pid
        self.offset = phorgedb.others_since(phorgedb.status(conn), phorgedb.status(conn), {})

    def wait_archived(self, consumer: Consumer, batch: Batch, every: float) -> tuple[float, float]:
        """When the bench first saw the batch being worked on, and all archived."""
        moved, last, first = time.monotonic(), -1, None
        while True:
            active, leased, archived = phorgedb.progress(self.conn, batch)
            if first is None and (leased or archived):
                first = time.time()
            if not active and archived == batch.size:
                return first or time.time(), time.time()
            if archived != last:
                moved, last = time.monotonic(), archived
            elif time.monotonic() - moved > STALL_TIMEOUT:
                state = f"{archived} of {batch.size} archived, {active} active, {leased} leased"
                raise procs.BenchError(f"{consumer.label}: no progress for 30 s ({state})")
            consumer.check()
            time.sleep(every)

    def ran(self, consumer: Consumer, batch: Batch) -> tuple[list[Record], list[Record]]:
        """All records, once every task of the batch has one; and the batch's runs."""
        directory, ids, found = consumer.records, set(batch.ids()), []
        assert directory

        def complete() -> bool:
            found[:] = read_records(directory)
            return ids <= {r.task_id for r in found if r.name == consumer.execute_name}

        procs.wait_until(complete, timeout=30, what=f"{consumer.label}'s records", interval=0.02)
        return found, [r for r in found if r.name == consumer.execute_name and r.task_id in ids]

    def warm_up(self, consumer: Consumer, workload: Workload, count: int) -> None:
        """A small batch first: proves the consumer works, and warms its processes."""
        batch = phorgedb.enqueue(self.conn, count, workload.data, workload.task_class)
        self.wait_archived(consumer, batch, 0.01)
        if consumer.records:
            self.ran(consumer, batch)

    def sample(self, consumer: Consumer) -> Sample:
        db, broker = procs.scan()[self.db_pid].cpu, rabbit.cpu()
        machine, bench = procs.MachineCPU.sample(), time.process_time()
        return Sample(consumer.cpu(), db, broker, machine, bench, phorgedb.status(self.conn))

    def throughput(self, consumer: Consumer, workload: Workload, count: int) -> Throughput:
        """All ``count`` tasks in one transaction; the run's figures once all are archived."""
        consumer.check()
        before, since = self.sample(consumer), time.time()
        batch = phorgedb.enqueue(self.conn, count, workload.data, workload.task_class)
        consumer.released()
        first, end = self.wait_archived(consumer, batch, 0.05 if consumer.records else 0.01)
        records, runs = self.ran(consumer, batch) if consumer.records else ([], [])
        after = self.sample(consumer)
        end, first = max([r.end for r in runs] or [end]), min([r.start for r in runs] or [first])
        polls = [r.cpu for r in records if r.name == consumer.poll_name and since < r.end <= end]
        twice = sorted(i for i, n in Counter(r.task_id for r in runs).items() if n > 1)
        failed = phorgedb.failed(self.conn, batch)
        problems = [f"{failed} archived with a result other than 0"] if failed else []
        if twice:
            problems.append(f"{len(twice)} task(s) executed more than once, e.g. {twice[:5]}")
        return Throughput(
            count, end - batch.committed, first - batch.committed,
            {role: after.cpu[role] - before.cpu.get(role, 0.0) for role in after.cpu},
            after.broker - before.broker,
            *after.machine.since(before.machine, after.known_since(before)),
            db_cpu=after.db - before.db,
            client=counters_between(records, since, end) if records else None,
            server=phorgedb.others_since(before.status, after.status, self.offset),
            poll_cpu=sum(polls) if consumer.poll_name else None, problems=problems,
        )  # fmt: skip


CELERY_APP = """\
import os
from celery import Celery

app = Celery("ceiling", broker=os.environ["BENCH_CEILING_BROKER"])
app.conf.update(task_ignore_result=True, task_acks_late=True, worker_prefetch_multiplier=1,
                worker_send_task_events=False, task_default_queue="ceiling")


@app.task(name="ceiling.noop")
def noop(number):
    return None
"""


def plain_celery(broker: str, scratch: Path, count: int, concurrency: int) -> Throughput:
    """Plain Celery on the same broker with the bridge's message settings (acks late,
    prefetch 1, no results, no events), no database: ``count`` no-op tasks sent by the
    bench, timed from the first send to the last one's end in the worker."""
    from celery import Celery

    consumer = Consumer("plain Celery", scratch)
    directory, env = consumer.hooked("celery-ceiling-")
    (directory / "ceiling_app.py").write_text(CELERY_APP)
    env["BENCH_CEILING_BROKER"] = broker
    command = f"-m celery -A ceiling_app worker -c {concurrency} -n ceiling@%h -l WARNING"
    command += " --without-mingle --without-gossip"
    app = Celery("sender", broker=broker)
    app.conf.update(task_ignore_result=True, task_default_queue="ceiling")

    def send_and_wait(numbers: range) -> list[Record]:
        with app.producer_or_acquire() as producer:
            for number in numbers:
                app.send_task("ceiling.noop", args=(number,), producer=producer)
        runs: list[Record] = []

        def done() -> bool:
            assert consumer.records
            runs[:] = [r for r in read_records(consumer.records) if r.task_id in numbers]
            return len(runs) >= len(numbers)

        what = "the plain Celery worker"
        procs.wait_until(done, timeout=120, what=what, interval=0.02, check=consumer.check)
        return runs

    try:
        consumer.start_hooked("workers", [[sys.executable, *command.split()]], env, directory)
        send_and_wait(range(4 * concurrency))  # warm-up
        cpu, broker_cpu, bench = consumer.cpu()["workers"], rabbit.cpu(), time.process_time()
        machine, started = procs.MachineCPU.sample(), time.time()
        runs = send_and_wait(range(1_000_000, 1_000_000 + count))
        cpu, broker_cpu = consumer.cpu()["workers"] - cpu, rabbit.cpu() - broker_cpu
        known = cpu + broker_cpu + time.process_time() - bench
        end, first = max(r.end for r in runs) - started, min(r.start for r in runs) - started
        shares = procs.MachineCPU.sample().since(machine, known)
        return Throughput(count, end, first, {"workers": cpu}, broker_cpu, *shares)
    finally:
        consumer.stop()
        app.close()
