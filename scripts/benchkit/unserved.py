"""Issue 21's unserved scenario: what rows the bridge must skip cost its drain rate.

The same consumer drains the same served no-op rows (priority 4000) twice: alone, then
behind ``rows`` rows of a class it does not serve (left to PHP) queued at priority 1000,
the case where a poll's candidate SELECT walks the priority index through all of them.
Each drain is a ``Runner.throughput`` run, so it comes with MariaDB's CPU per task; there
are ``ROUNDS`` of each kind, a drain being short enough for one slow moment to move it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import MySQLdb

from benchkit import phorgedb
from benchkit.consumers import Consumer
from benchkit.runner import Runner, Throughput, Workload

UNSERVED_CLASS = "PhabricatorRepositoryCommitParserWorker"  # no handler: left to PHP
UNSERVED_DATA = '{"commitID":1}'
UNSERVED_PRIORITY = 1000
SERVED_PRIORITY = 4000
ROUNDS = 3  # drains of each kind: one of 3,000 no-op rows lasts a second or two


@dataclass
class Drains:
    """Several drains of the same rows, taken together."""

    runs: list[Throughput]

    @property
    def tasks(self) -> int:
        return sum(t.tasks for t in self.runs)

    @property
    def rate(self) -> float:
        """Tasks per second over all the drains (each timed from its COMMIT)."""
        return self.tasks / sum(t.seconds for t in self.runs)

    def per_task(self, cpu: Callable[[Throughput], float]) -> float:
        """CPU seconds per archived task, ``cpu`` read from each drain."""
        return sum(cpu(t) for t in self.runs) / self.tasks

    @property
    def problems(self) -> list[str]:
        return [problem for t in self.runs for problem in t.problems]


@dataclass
class UnservedRun:
    rows: int  # unserved rows queued ahead in the second drain
    load_seconds: float  # what queueing them took (INSERT ... SELECT and ANALYZE)
    alone: Drains
    behind: Drains

    @property
    def ratio(self) -> float:
        """The drain rate behind the unserved rows, against alone (issue 21: >= 0.8)."""
        return self.behind.rate / self.alone.rate


def run(
    conn: MySQLdb.Connection,
    runner: Runner,
    consumer: Consumer,
    served: Workload,
    count: int,
    rows: int,
    log: Callable[[str], None],
) -> UnservedRun:
    """``ROUNDS`` drains of ``count`` served rows alone, then the unserved rows queued,
    as many drains again behind them."""

    def drains() -> Drains:
        return Drains(
            [runner.throughput(consumer, served, count, SERVED_PRIORITY) for _ in range(ROUNDS)]
        )

    alone = drains()
    log(f"{consumer.label}: {alone.rate:,.0f} tasks/s alone; queueing {rows:,} unserved rows")
    started = time.monotonic()
    phorgedb.load(conn, rows, UNSERVED_CLASS, UNSERVED_DATA, UNSERVED_PRIORITY)
    loaded = time.monotonic() - started
    # The first drains' archive rows stay: they are nothing to the lease statements.
    return UnservedRun(rows, loaded, alone, drains())
