"""What the measured processes record about themselves, and the bench's reading of it.

:func:`install`, called by the ``sitecustomize.py`` the bench puts first on their path
(the bridge runs unmodified), counts database requests in MySQLdb (SQLAlchemy's events miss
the bridge's raw DBAPI round trips) and appends a line per Celery task and per Phorge task
run to ``<BENCH_RECORD_DIR>/<pid>.rec``; it marks readiness in ``BENCH_READY_DIR`` and
``worker -B``'s beat as ``<pid>.beat``. One ``os.write`` a line on an ``O_APPEND`` file:
no half lines between processes or threads, none lost when a process is killed.
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

RECORD_DIR, READY_DIR, BRIDGE_RUNS = "BENCH_RECORD_DIR", "BENCH_READY_DIR", "BENCH_BRIDGE_RUNS"
BEAT_SUFFIX = ".beat"
# A quoted string or identifier, backslash escapes included: ``;`` inside does not split.
_QUOTED = re.compile(rb"'[^'\\]*(?:\\.[^'\\]*)*'|\"[^\"\\]*(?:\\.[^\"\\]*)*\"|`[^`]*`", re.DOTALL)
_CONTROL = {b"START", b"BEGIN", b"ROLLBACK"}  # transaction control: no statement


class Counters(NamedTuple):
    """Client-side requests: statements (no transaction control), commits, round trips."""

    statements: int = 0
    commits: int = 0
    round_trips: int = 0

    def minus(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(self, other, strict=True)))


def latest(counters: Iterable[Counters]) -> Counters:
    """The highest of cumulative counters, field by field (threads record out of order)."""
    return Counters(*map(max, zip(Counters(), *counters, strict=False)))


class CounterBox:
    """A process's cumulative counters, bumped from any thread."""

    def __init__(self) -> None:
        self.lock, self.values = threading.Lock(), [0, 0, 0]

    def bump(self, statements: int, commits: int, round_trips: int = 1) -> None:
        with self.lock:
            for i, n in enumerate((statements, commits, round_trips)):
                self.values[i] += n

    def snapshot(self) -> Counters:
        with self.lock:
            return Counters(*self.values)


COUNTERS = CounterBox()
_split: dict[bytes, tuple[int, int]] = {}  # SQL text -> (statements, commits), split once


def split(query: bytes | str) -> tuple[int, int]:
    """(statements, commits) of one query; quoted ``;`` ignored, empty parts dropped."""
    raw = query.encode() if isinstance(query, str) else bytes(query)
    found = _split.get(raw)
    if found is None:
        parts = [raw] if b";" not in raw else _QUOTED.sub(b"?", raw).split(b";")
        words = [p.split(None, 1)[0].upper() for p in parts if p.strip()]
        commits = words.count(b"COMMIT")
        found = (sum(w not in _CONTROL for w in words) - commits, commits)
        if len(_split) < 10_000 and isinstance(query, str):  # a template: worth keeping
            _split[raw] = found
    return found


class RecordWriter:
    """Appends to ``<dir>/<pid>.rec``; a forked child opens its own file."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory, self.fd, self.lock = Path(directory), -1, threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.lock = -1, threading.Lock()

    def write(self, name: str, task_id: int | None, *times: float, counters: Counters) -> None:
        """One line: ``name``, the task id, start, end and CPU seconds, the counters."""
        if self.fd < 0:
            with self.lock:
                if self.fd < 0:
                    path = self.directory / f"{os.getpid()}.rec"
                    self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        fields = [name, "-" if task_id is None else str(task_id), *(f"{t:.6f}" for t in times)]
        os.write(self.fd, (" ".join(fields + [str(c) for c in counters]) + "\n").encode())


class Spans:
    """Open spans by key (a dict's set and pop are atomic); ``end`` writes the record."""

    def __init__(self, writer: RecordWriter) -> None:
        self.writer = writer
        self.open: dict[Any, tuple[float, float]] = {}

    def start(self, key: Any) -> None:
        self.open[key] = (time.time(), time.thread_time())

    def end(self, key: Any, name: str, task_id: int | None) -> None:
        end, cpu = time.time(), time.thread_time()
        start, cpu0 = self.open.pop(key, (end, cpu))
        self.writer.write(name, task_id, start, end, cpu - cpu0, counters=COUNTERS.snapshot())


@dataclass(frozen=True)
class Record:
    pid: int
    name: str
    task_id: int | None
    start: float
    end: float
    cpu: float  # thread CPU seconds inside the task
    counters: Counters  # the process's, cumulative, at the end


def read_records(directory: Path) -> list[Record]:
    found = []
    for path in sorted(directory.glob("*.rec")):
        for line in path.read_text().splitlines():
            name, tid, start, end, cpu, *counts = line.split()
            times = float(start), float(end), float(cpu)
            task_id = None if tid == "-" else int(tid)
            found.append(Record(int(path.stem), name, task_id, *times, Counters(*map(int, counts))))
    return found


def counters_between(records: list[Record], since: float, until: float) -> Counters:
    """Requests of all processes between two instants, from their cumulative counters."""
    total = Counters()
    for pid in {r.pid for r in records}:
        mine = [r for r in records if r.pid == pid]
        before = latest(r.counters for r in mine if r.end <= since)
        after = latest(r.counters for r in mine if r.end <= until)
        total = Counters(*(t + d for t, d in zip(total, after.minus(before), strict=True)))
    return total


def percentile(values: list[float], fraction: float) -> float:
    """Nearest rank: every figure is a measured value."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(fraction * len(ordered)))) - 1]


# -- in the measured processes -------------------------------------------------------------


def install() -> None:
    """Every hook, if this process is one the bench measures."""
    record_dir = os.environ.get(RECORD_DIR)
    if not record_dir:
        return
    count_requests()
    writer = RecordWriter(record_dir)
    from celery import signals

    spans = Spans(writer)

    def postrun(task_id: str, task: Any, args: Any = None, **_: Any) -> None:
        first = args[0] if args else None
        spans.end(task_id, task.name, first if type(first) is int else None)

    def mark(directory: str | None, suffix: str = "") -> None:
        if directory:
            open(os.path.join(directory, f"{os.getpid()}{suffix}"), "w").close()

    signals.task_prerun.connect(lambda task_id, **_: spans.start(task_id), weak=False)
    signals.task_postrun.connect(postrun, weak=False)
    signals.worker_ready.connect(lambda **_: mark(os.environ.get(READY_DIR)), weak=False)
    signals.beat_embedded_init.connect(lambda **_: mark(record_dir, BEAT_SUFFIX), weak=False)
    if os.environ.get(BRIDGE_RUNS):  # in the worker's main process, before the pool forks
        from benchkit.bridge_api import RUN_RECORD

        signals.worker_init.connect(lambda **_: record_runs(writer, RUN_RECORD), weak=False)


def record_runs(writer: RecordWriter, name: str) -> None:
    """A record ``name`` for each Phorge task run in this process (a message may carry several)."""
    from benchkit import bridge_api

    spans = Spans(writer)
    bridge_api.observe_runs(spans.start, lambda task: spans.end(task, name, task))


def count_requests() -> None:
    """Wrap MySQLdb's methods that each make one round trip."""
    from MySQLdb.connections import Connection
    from MySQLdb.cursors import BaseCursor

    query, execute = Connection.query, BaseCursor.execute
    inside = threading.local()  # in a cursor execute: counted by its SQL text already

    def counted_query(self: Any, sql: Any) -> Any:
        if not getattr(inside, "on", False):
            COUNTERS.bump(*split(sql))
        return query(self, sql)

    def counted_execute(self: Any, sql: Any, args: Any = None) -> Any:
        COUNTERS.bump(*split(sql))  # the template (str), or executemany's finished bulk insert
        inside.on = True
        try:
            return execute(self, sql, args)
        finally:
            inside.on = False

    def counting(method: Any, commits: int) -> Any:
        def counted(self: Any, *args: Any) -> Any:
            COUNTERS.bump(0, commits)
            return method(self, *args)

        return counted

    Connection.query, BaseCursor.execute = counted_query, counted_execute  # type: ignore[method-assign]
    for name in ("commit", "rollback", "ping", "autocommit"):
        setattr(Connection, name, counting(getattr(Connection, name), int(name == "commit")))


if __name__ == "__main__":  # the SQL loop ceiling: python3 -m benchkit.records READY RECORDS
    from benchkit import bridge_api
    from benchkit import records as hooked  # the copy sitecustomize loaded, whose COUNTERS count

    hooked.record_runs(hooked.RecordWriter(sys.argv[2]), bridge_api.SQL_LOOP_RECORD)
    bridge_api.sql_loop(Path(sys.argv[1]))
