"""One measured run: enqueue, wait for the archive, collect every figure, check the outcome.

The same procedure serves every consumer, so their figures compare:

- the clock starts when the enqueue transaction's COMMIT returns and stops when the last
  task of the batch was archived: the latest "archived" record of the consumer's own
  processes when it writes records (exact), else the moment the bench saw the archive
  complete (phd; the bench polls every ``POLL_NO_RECORDS`` s);
- the bench polls the database on its own connection, whose requests it subtracts from
  the server's global counters (``phorgedb.ServerSample``);
- CPU is sampled from /proc before the enqueue and after the end, before any shutdown.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import MySQLdb

from benchkit import phorgedb, procs, rabbit
from benchkit.consumers import Consumer
from benchkit.phorgedb import Batch, ServerSample
from benchkit.records import Counters, Record, counters_between, percentile, read_records

POLL_WITH_RECORDS = 0.05  # the records give the exact end; the poll only detects it
POLL_NO_RECORDS = 0.01
POLL_LIGHT = 0.005
RECORDS_TIMEOUT = 30.0  # for the last records to reach disk after the archive is complete
STALL_TIMEOUT = 30.0  # a run fails when nothing is archived for this long


@dataclass(frozen=True)
class Workload:
    key: str  # used in scenario names
    label: str
    data: dict[str, Any]
    measure: str = "throughput"  # or "priority", "unserved": what a run of it measures
    task_class: str = phorgedb.TASK_CLASS
    # When set, the tasks take these data in turn instead of ``data`` (the PHP section's
    # search tasks, over documents only known once Phorge is set up).
    variants: tuple[str, ...] = ()

    @property
    def data_json(self) -> str:
        return json.dumps(self.data, separators=(",", ":"))

    @property
    def payload(self) -> str | tuple[str, ...]:
        """What ``phorgedb.enqueue`` is given as the tasks' data."""
        return self.variants or self.data_json


NOOP = Workload("noop", "no-op", {})
SLEEP10 = Workload("10ms", "10 ms sleep", {"duration": 0.01})
IO50 = Workload("io50", "50 ms I/O-bound", {"duration": 0.05})
# Issue 21: urgent tasks behind a backlog of these (``priority``), and served no-op rows
# behind rows the bridge does not serve (``unserved``).
PRIORITY = Workload("priority", "backlog of 50 ms tasks", {"duration": 0.05}, "priority")
PRIORITY_1S = Workload("priority-1s", "backlog of 1 s tasks", {"duration": 1.0}, "priority")
UNSERVED = Workload("unserved", "no-op behind unserved rows", {}, "unserved")


@dataclass(frozen=True)
class Seen:
    """When the bench's polling first saw the batch being worked on, and all archived."""

    started: float
    done: float


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Percentiles | None:
        if not values:
            return None
        return cls(*(percentile(values, f) for f in (0.50, 0.95, 0.99)))


@dataclass
class Latency:
    """Seconds from enqueue (commit) to start and to archive."""

    to_start: Percentiles | None  # None: the consumer records no start (phd)
    to_archive: Percentiles | None


@dataclass
class Throughput:
    tasks: int
    seconds: float  # from the enqueue COMMIT to the last archive
    first_start: float  # from the enqueue COMMIT to the first task's start
    latency: Latency
    client: Counters | None  # None: the consumer records no counters
    server: dict[str, int]
    cpu: dict[str, float]  # role -> CPU seconds during the run
    poller_cpu: float | None
    db_cpu: float
    broker_cpu: float | None
    machine_busy: float  # 0..1 of all cores
    others_busy: float  # 0..1 of all cores, used by processes the bench does not account for
    problems: list[str] = field(default_factory=list)
    machine_cpu: float | None = None  # CPU seconds the machine was busy, whoever used them
    bench_cpu: float | None = None  # the bench's own process (enqueue, polling, pings)
    mean_duration: float | None = None  # mean archived ``duration``: the worker's own run

    @property
    def rate(self) -> float:
        """Tasks per second from the enqueue COMMIT: what draining a backlog takes."""
        return self.tasks / self.seconds if self.seconds > 0 else float("nan")


class Runner:
    """Drives runs against one database server on the bench's own connection."""

    def __init__(self, conn: MySQLdb.Connection, db_pid: int, log: Callable[[str], None]) -> None:
        self.conn, self.db_pid, self.log = conn, db_pid, log
        self.offset = phorgedb.calibrate(conn)

    # -- waiting ------------------------------------------------------------------------

    def wait_archived(self, consumer: Consumer, batch: Batch, interval: float) -> Seen:
        """Poll until the active table is empty and the batch is archived.

        Fails if the consumer dies or nothing is archived for ``STALL_TIMEOUT`` seconds.
        """
        last_progress, last_archived, first = time.monotonic(), -1, None
        while True:
            now = phorgedb.progress(self.conn, batch)
            if first is None and now.started():
                first = time.time()
            if now.done(batch):
                done = time.time()
                return Seen(first or done, done)
            if now.archived != last_archived:
                last_progress, last_archived = time.monotonic(), now.archived
            elif time.monotonic() - last_progress > STALL_TIMEOUT:
                raise procs.BenchError(
                    f"{consumer.label}: no progress for {STALL_TIMEOUT:.0f} s ({now.archived}"
                    f" of {batch.size} archived, {now.active} rows active, {now.leased} leased)"
                )
            consumer.check()
            time.sleep(interval)

    def batch_records(self, consumer: Consumer, batch: Batch) -> list[Record]:
        """The consumer's records, once every task of the batch has one."""
        directory = consumer.records
        assert directory is not None
        ids = set(batch.ids())
        found: list[Record] = []

        def complete() -> bool:
            nonlocal found
            found = read_records(directory)
            seen = {r.task_id for r in found if r.name == consumer.execute_name}
            return ids <= seen

        procs.wait_until(
            complete, timeout=RECORDS_TIMEOUT, what=f"{consumer.label}'s records", interval=0.02
        )
        return found

    # -- runs ---------------------------------------------------------------------------

    def warm_up(self, consumer: Consumer, workload: Workload, count: int) -> None:
        """Run a small batch first: proves the consumer works, and warms its processes."""
        batch = phorgedb.enqueue(self.conn, count, workload.payload, task_class=workload.task_class)
        self.wait_archived(consumer, batch, POLL_NO_RECORDS)
        if consumer.records is not None:
            self.batch_records(consumer, batch)

    def light(self, consumer: Consumer, workload: Workload, samples: int) -> Latency:
        """One task at a time: enqueue, wait until archived, pause at random, repeat.

        The random pause (0 to one poll interval or idle sleep) spreads the enqueue
        moments over the consumer's cycle, as independent arrivals would: enqueued
        right after the previous archive, a task would always find a PHP-style
        taskmaster at the start of its one-second sleep.
        """
        to_start: list[float] = []
        to_archive: list[float] = []
        pauses = random.Random(samples)
        for _ in range(samples):
            time.sleep(pauses.uniform(0, consumer.cycle))
            batch = phorgedb.enqueue(self.conn, 1, workload.data_json)
            seen = self.wait_archived(consumer, batch, POLL_LIGHT)
            if consumer.records is None:
                to_archive.append(seen.done - batch.committed)
                continue
            record = self._execution(self.batch_records(consumer, batch), consumer, batch.first)
            to_start.append(record.start - batch.committed)
            to_archive.append(record.end - batch.committed)
        return Latency(Percentiles.of(to_start), Percentiles.of(to_archive))

    @staticmethod
    def _execution(records: list[Record], consumer: Consumer, task_id: int) -> Record:
        return next(r for r in records if r.name == consumer.execute_name and r.task_id == task_id)

    def throughput(
        self,
        consumer: Consumer,
        workload: Workload,
        count: int,
        priority: int = phorgedb.PRIORITY_DEFAULT,
    ) -> Throughput:
        """All ``count`` tasks in one transaction; the figures of the run until all archived."""
        consumer.check()
        cpu_before, db_before = consumer.cpu(), procs.process_cpu(self.db_pid)
        broker_pid = rabbit.rabbitmq_pid()
        broker_before = procs.process_cpu(broker_pid) if broker_pid else None
        machine_before, bench_before = procs.MachineCPU.sample(), time.process_time()
        server_before = ServerSample.take(self.conn)
        since = time.time()
        batch = phorgedb.enqueue(self.conn, count, workload.payload, priority, workload.task_class)
        consumer.released()
        interval = POLL_WITH_RECORDS if consumer.records is not None else POLL_NO_RECORDS
        seen = self.wait_archived(consumer, batch, interval)
        records = self.batch_records(consumer, batch) if consumer.records is not None else []
        ours = [r for r in records if r.name == consumer.execute_name and r.task_id in batch.ids()]
        end = max((r.end for r in ours), default=seen.done)
        first = min((r.start for r in ours), default=seen.started)
        # Sample everything at once, before anything else happens.
        cpu_after, db_after = consumer.cpu(), procs.process_cpu(self.db_pid)
        broker_after = procs.process_cpu(broker_pid) if broker_pid else None
        machine_after, bench_cpu = procs.MachineCPU.sample(), time.process_time() - bench_before
        server = ServerSample.take(self.conn).others_since(server_before, self.offset)
        cpu = {role: cpu_after[role] - cpu_before.get(role, 0.0) for role in cpu_after}
        db_cpu = db_after - db_before
        broker_cpu = None if broker_after is None else broker_after - (broker_before or 0.0)
        capacity = machine_after.capacity_since(machine_before)
        known = sum(cpu.values()) + db_cpu + (broker_cpu or 0.0) + bench_cpu
        busy = machine_after.busy_share_since(machine_before)

        problems = phorgedb.check_archived(self.conn, batch) + duplicates(ours)
        by_id = {r.task_id: r for r in ours}
        latency = Latency(
            Percentiles.of([r.start - batch.committed for r in by_id.values()]),
            Percentiles.of([r.end - batch.committed for r in by_id.values()]),
        )
        until = end  # polls after the last archive are not the batch's cost
        poller = None
        if consumer.poll_name:
            polls = [r for r in records if r.name == consumer.poll_name and since < r.end <= until]
            poller = sum(r.cpu for r in polls)
        return Throughput(
            tasks=count,
            seconds=end - batch.committed,
            first_start=first - batch.committed,
            latency=latency,
            client=counters_between(records, since, until) if records else None,
            server=server,
            cpu=cpu,
            poller_cpu=poller,
            db_cpu=db_cpu,
            broker_cpu=broker_cpu,
            machine_busy=busy,
            others_busy=max(0.0, busy - known / capacity) if capacity else 0.0,
            problems=problems,
            machine_cpu=machine_after.busy_seconds_since(machine_before),
            bench_cpu=bench_cpu,
            mean_duration=phorgedb.mean_duration(self.conn, batch),
        )


def duplicates(records: list[Record]) -> list[str]:
    """Tasks the consumer executed more than once (the archive itself cannot show it)."""
    counts = Counter(r.task_id for r in records)
    twice = sorted(task_id for task_id, n in counts.items() if n > 1)
    return [f"{len(twice)} task(s) executed more than once, e.g. {twice[:5]}"] if twice else []
