"""Per-task records that measured processes append to files of their own, and their reading.

Every consumer (bridge worker children through ``hook``, the reference taskmaster, the
SQL loop, the plain Celery ceiling) writes one line per finished task to
``<dir>/<pid>.rec``: when it started, when it was archived (``time.time()``, comparable
with the bench's enqueue clock), the thread CPU it took, and the process's *cumulative*
database counters at that moment. One ``os.write`` per line on an ``O_APPEND`` file is
atomic, so threads and processes never interleave half lines, and nothing needs flushing
when a process is killed.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass
class Counters:
    """Client-side database requests (see ``hook``): statements by kind, and round trips.

    A commit is a COMMIT statement or a driver ``commit()`` call; one round trip may
    carry several statements (a multi-statement query).
    """

    statements: int = 0  # SQL statements other than transaction control
    begins: int = 0  # START TRANSACTION / BEGIN statements
    commits: int = 0
    rollbacks: int = 0
    pings: int = 0
    others: int = 0  # autocommit() calls
    round_trips: int = 0  # requests sent: queries, commit(), rollback(), ping(), ...

    def as_tuple(self) -> tuple[int, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def from_tuple(cls, values: Iterable[int]) -> Counters:
        return cls(*values)

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def elementwise_max(self, other: Counters) -> Counters:
        return Counters(*map(max, self.as_tuple(), other.as_tuple()))


class CounterBox:
    """A process's cumulative counters, safe to bump from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = Counters()

    def bump(self, *names: str) -> None:
        with self._lock:
            for name in names:
                setattr(self._values, name, getattr(self._values, name) + 1)

    def snapshot(self) -> Counters:
        with self._lock:
            return Counters(*self._values.as_tuple())


@dataclass(frozen=True)
class Record:
    """One finished task as its process saw it."""

    pid: int
    name: str
    task_id: int | None
    start: float
    end: float
    cpu: float  # thread CPU seconds spent inside the task
    counters: Counters


class RecordWriter:
    """Appends records to ``<dir>/<pid>.rec``, reopening after a fork; thread-safe."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._pid = -1
        self._fd = -1
        self._lock = threading.Lock()

    def _file(self) -> int:
        """This process's file, opened once even when threads race for it."""
        pid = os.getpid()
        if self._pid != pid:
            with self._lock:
                if self._pid != pid:
                    path = self.directory / f"{pid}.rec"
                    # The descriptor first: a thread that sees the pid must see it too.
                    self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    self._pid = pid
        return self._fd

    def write(
        self,
        name: str,
        task_id: int | None,
        start: float,
        end: float,
        cpu: float,
        counters: Counters,
    ) -> None:
        values = " ".join(map(str, counters.as_tuple()))
        tid = "-" if task_id is None else str(task_id)
        line = f"{name} {tid} {start:.6f} {end:.6f} {cpu:.6f} {values}\n"
        os.write(self._file(), line.encode())


def read_records(directory: Path) -> list[Record]:
    """Every complete line of every ``*.rec`` file in ``directory``."""
    records = []
    for path in sorted(directory.glob("*.rec")):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 5 + len(fields(Counters)):
                continue  # a line still being written (cannot happen with O_APPEND; be safe)
            name, tid, start, end, cpu, *counts = parts
            records.append(
                Record(
                    pid=pid,
                    name=name,
                    task_id=None if tid == "-" else int(tid),
                    start=float(start),
                    end=float(end),
                    cpu=float(cpu),
                    counters=Counters.from_tuple(int(c) for c in counts),
                )
            )
    return records


def counters_between(records: list[Record], since: float, until: float) -> Counters:
    """Requests all processes made between two instants, from their cumulative counters.

    Per process: the highest counters recorded by ``until`` minus the highest recorded by
    ``since`` (zero when the process had recorded nothing yet). Work a process did after
    its last record before ``until`` is not seen; the caller picks ``until`` at the last
    task of the run, so only requests of an unfinished poll can be missed.
    """
    total = Counters()
    for pid in {r.pid for r in records}:
        before, after = Counters(), Counters()
        for record in (r for r in records if r.pid == pid):
            if record.end <= since:
                before = before.elementwise_max(record.counters)
            if record.end <= until:
                after = after.elementwise_max(record.counters)
        total = total + (after - before)
    return total


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (no interpolation: every figure is a measured value)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]
