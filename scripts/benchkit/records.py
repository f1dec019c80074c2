"""What the measured processes record about themselves, and the bench's reading of it.

:func:`install`, called by the ``sitecustomize.py`` the bench puts first on their path
(the bridge runs unmodified), counts database requests in MySQLdb (SQLAlchemy's events miss
the bridge's raw DBAPI round trips) and appends a line per Celery task and per Phorge task
run to ``<BENCH_RECORD_DIR>/<pid>.rec``; it marks readiness in ``BENCH_READY_DIR`` and
``worker -B``'s beat as ``<pid>.beat``. One ``os.write`` a line on an ``O_APPEND`` file:
no half lines between processes or threads, none lost when a process is killed.
"""

from __future__ import annotations

import os
import re
import threading
import time
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


_counts, _lock = [0, 0, 0], threading.Lock()  # this process's Counters, from any thread
_split: dict[bytes, tuple[int, int]] = {}  # SQL text -> (statements, commits), split once


def bump(statements: int, commits: int, round_trips: int = 1) -> None:
    with _lock:
        for i, n in enumerate((statements, commits, round_trips)):
            _counts[i] += n


def counters() -> Counters:
    """This process's requests so far."""
    with _lock:
        return Counters(*_counts)


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
        self.writer.write(name, task_id, start, end, cpu - cpu0, counters=counters())


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
    """Requests of all processes between two instants: each process's counters at
    ``until`` less those at ``since``, the highest of each field (threads write late)."""
    total = [0, 0, 0]
    for pid in {r.pid for r in records}:
        for at, sign in ((until, 1), (since, -1)):
            seen = [r.counters for r in records if r.pid == pid and r.end <= at]
            total = [t + sign * max((c[i] for c in seen), default=0) for i, t in enumerate(total)]
    return Counters(*total)


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
            bump(*split(sql))
        return query(self, sql)

    def counted_execute(self: Any, sql: Any, args: Any = None) -> Any:
        bump(*split(sql))  # the template (str), or executemany's finished bulk insert
        inside.on = True
        try:
            return execute(self, sql, args)
        finally:
            inside.on = False

    def counting(method: Any, commits: int) -> Any:
        def counted(self: Any, *args: Any) -> Any:
            bump(0, commits)
            return method(self, *args)

        return counted

    Connection.query, BaseCursor.execute = counted_query, counted_execute  # type: ignore[method-assign]
    for name in ("commit", "rollback", "ping", "autocommit"):
        setattr(Connection, name, counting(getattr(Connection, name), int(name == "commit")))
