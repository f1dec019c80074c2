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

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(a + b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(self.as_tuple(), other.as_tuple(), strict=True)))

    def elementwise_max(self, other: Counters) -> Counters:
        return Counters(*map(max, self.as_tuple(), other.as_tuple()))


COUNTER_NAMES = tuple(f.name for f in fields(Counters))


class CounterBox:
    """A process's cumulative counters, safe to bump from several threads.

    A plain list bumped by positions computed once (:meth:`indexes`), and read as a
    tuple: the hook bumps it on every query and reads it on every task of the measured
    process, whose CPU per task the bench reports.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = [0] * len(COUNTER_NAMES)

    @staticmethod
    def indexes(*names: str) -> tuple[int, ...]:
        """The positions :meth:`bump` takes for ``names`` (a name given twice counts twice)."""
        return tuple(COUNTER_NAMES.index(name) for name in names)

    def bump(self, indexes: tuple[int, ...]) -> None:
        with self._lock:
            values = self._values
            for index in indexes:
                values[index] += 1

    def snapshot(self) -> tuple[int, ...]:
        """The counters in ``Counters`` field order: ``Counters(*box.snapshot())``."""
        with self._lock:
            return tuple(self._values)


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


# What ``read_records`` parses: ``name tid start end cpu`` and the counters.
_LINE = "%s %s %.6f %.6f %.6f" + " %d" * len(COUNTER_NAMES) + "\n"


class RecordWriter:
    """Appends records to ``<dir>/<pid>.rec``; thread-safe.

    Made before the bridge's prefork pool forks, so a child must not write to its
    parent's file: a fork hook drops the descriptor and the child's first write opens
    its own (cheaper than comparing ``os.getpid()`` on every write).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._fd = -1  # opened by the first write: a process that records nothing has no file
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget_parent_file)

    def _forget_parent_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork

    def _open(self) -> int:
        """This process's file, opened once even when threads race for it."""
        with self._lock:
            if self._fd < 0:
                path = self.directory / f"{os.getpid()}.rec"
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            return self._fd

    def write(
        self,
        name: str,
        task_id: int | None,
        start: float,
        end: float,
        cpu: float,
        counters: tuple[int, ...],
    ) -> None:
        """Append one line; ``counters`` as :meth:`CounterBox.snapshot` gives them."""
        fd = self._fd
        if fd < 0:
            fd = self._open()
        tid = "-" if task_id is None else task_id
        os.write(fd, (_LINE % (name, tid, start, end, cpu, *counters)).encode())


def read_records(directory: Path) -> list[Record]:
    """Every complete line of every ``*.rec`` file in ``directory``."""
    records = []
    for path in sorted(directory.glob("*.rec")):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 5 + len(COUNTER_NAMES):
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
                    counters=Counters(*(int(c) for c in counts)),
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
