"""One measured run, the same for every consumer, so that their figures compare: from the
enqueue COMMIT to the last archive (the consumer's record of it, else when the bench saw
it: phd, polled every 10 ms); the bench's own requests left out; CPU before and after."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import MySQLdb

from benchkit import phorgedb, procs, rabbit
from benchkit.consumers import Consumer
from benchkit.phorgedb import Batch
from benchkit.records import Counters, Record, counters_between, percentile, read_records

STALL_TIMEOUT = 30.0  # a run fails when nothing is archived for this long


@dataclass(frozen=True)
class Workload:
    key: str  # in scenario names
    label: str
    data: dict[str, Any]
    task_class: str = phorgedb.TASK_CLASS
    variants: tuple[str, ...] = ()  # data the tasks take in turn instead (search documents)

    @property
    def data_json(self) -> str:
        return json.dumps(self.data, separators=(",", ":"))

    @property
    def payload(self) -> str | tuple[str, ...]:
        return self.variants or self.data_json


NOOP = Workload("noop", "no-op", {})
SLEEP10 = Workload("10ms", "10 ms sleep", {"duration": 0.01})
IO50 = Workload("io50", "50 ms I/O-bound", {"duration": 0.05})


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Percentiles | None:
        return cls(*(percentile(values, f) for f in (0.50, 0.95, 0.99))) if values else None


@dataclass
class Latency:
    """Seconds from enqueue (COMMIT) to start and to archive; None: not recorded (phd)."""

    to_start: Percentiles | None
    to_archive: Percentiles | None


@dataclass
class Throughput:
    tasks: int
    seconds: float  # from the enqueue COMMIT to the last archive
    first_start: float  # from the enqueue COMMIT to the first start
    latency: Latency
    client: Counters | None  # None: the consumer records no counters (phd)
    server: dict[str, int]  # MariaDB's status counters, the bench's own requests left out
    cpu: dict[str, float]  # role -> CPU seconds
    poll_cpu: float | None  # of which the bridge's polls, when they run in its workers
    db_cpu: float
    broker_cpu: float
    machine_cpu: float  # CPU seconds the machine was busy, whoever used them
    machine_busy: float  # 0..1 of all cores
    others_busy: float  # 0..1 of all cores, not explained by any measured process
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
    status: tuple[dict[str, int], dict[str, int]]


class Runner:
    """Drives runs on the bench's own connection."""

    def __init__(self, conn: MySQLdb.Connection, db_pid: int) -> None:
        self.conn, self.db_pid = conn, db_pid
        self.phds_share: int | None = None  # the bridge's weight while a canary is set
        self.offset = phorgedb.others_since(phorgedb.status(conn), phorgedb.status(conn), {})

    def enqueue(self, count: int, data: str | tuple[str, ...], task_class: str) -> Batch:
        """``count`` tasks; under a canary (``phds_share``: the bridge's weight), phd's
        share of them run by the bench as the shipped daemon would."""
        batch = phorgedb.enqueue(self.conn, count, data, task_class=task_class)
        if self.phds_share is None:
            return batch
        return phorgedb.run_phds_share(self.conn, batch, self.phds_share)

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
        directory, ids, found = consumer.records, set(batch.ids()) - batch.phds, []
        assert directory

        def complete() -> bool:
            found[:] = read_records(directory)
            return ids <= {r.task_id for r in found if r.name == consumer.execute_name}

        procs.wait_until(complete, timeout=30, what=f"{consumer.label}'s records", interval=0.02)
        return found, [r for r in found if r.name == consumer.execute_name and r.task_id in ids]

    def warm_up(self, consumer: Consumer, workload: Workload, count: int) -> None:
        """A small batch first: proves the consumer works, and warms its processes."""
        batch = self.enqueue(count, workload.payload, workload.task_class)
        self.wait_archived(consumer, batch, 0.01)
        if consumer.records:
            self.ran(consumer, batch)

    def light(self, consumer: Consumer, workload: Workload, samples: int) -> Latency:
        """One task at a time, each after a random pause of up to one cycle: independent
        arrivals, not always at the start of a taskmaster's sleep."""
        to_start, to_archive = [], []
        pauses = random.Random(samples)
        for _ in range(samples):
            time.sleep(pauses.uniform(0, consumer.cycle))
            batch = self.enqueue(1, workload.data_json, workload.task_class)
            _, done = self.wait_archived(consumer, batch, 0.005)
            if consumer.records:
                (run,) = self.ran(consumer, batch)[1]
                to_start.append(run.start - batch.committed)
                done = run.end
            to_archive.append(done - batch.committed)
        return Latency(Percentiles.of(to_start), Percentiles.of(to_archive))

    def sample(self, consumer: Consumer) -> Sample:
        db, broker = procs.scan()[self.db_pid].cpu, rabbit.cpu()
        machine, bench = procs.MachineCPU.sample(), time.process_time()
        return Sample(consumer.cpu(), db, broker, machine, bench, phorgedb.status(self.conn))

    def throughput(self, consumer: Consumer, workload: Workload, count: int) -> Throughput:
        """All ``count`` tasks in one transaction; the run's figures once all are archived."""
        consumer.check()
        before, since = self.sample(consumer), time.time()
        batch = self.enqueue(count, workload.payload, workload.task_class)
        consumer.released()
        first, end = self.wait_archived(consumer, batch, 0.05 if consumer.records else 0.01)
        records, runs = self.ran(consumer, batch) if consumer.records else ([], [])
        after = self.sample(consumer)
        end, first = max([r.end for r in runs] or [end]), min([r.start for r in runs] or [first])
        cpu = {role: after.cpu[role] - before.cpu.get(role, 0.0) for role in after.cpu}
        db, broker = after.db - before.db, after.broker - before.broker
        known = sum(cpu.values()) + db + broker + after.bench - before.bench
        shares = after.machine.shares(before.machine, known)
        polls = [r.cpu for r in records if r.name == consumer.poll_name and since < r.end <= end]
        twice = sorted(i for i, n in Counter(r.task_id for r in runs).items() if n > 1)
        problems = phorgedb.problems(self.conn, batch)
        if twice:
            problems.append(f"{len(twice)} task(s) executed more than once, e.g. {twice[:5]}")
        t0 = batch.committed
        latency = Latency(
            Percentiles.of([r.start - t0 for r in runs]), Percentiles.of([r.end - t0 for r in runs])
        )
        return Throughput(
            count, end - t0, first - t0, latency,
            counters_between(records, since, end) if records else None,
            phorgedb.others_since(before.status, after.status, self.offset), cpu,
            sum(polls) if consumer.poll_name else None, db, broker,
            after.machine.busy_seconds_since(before.machine), *shares, problems,
        )  # fmt: skip
