"""The guard's short window kept in its process: each judged class's archive rows of the
last ``BRIDGE_CANARY_WINDOW`` s (fewer where the window is cut), and their sums, brought
up to date at each evaluation with the rows archived since the previous one.

Read afresh (``guard.read_windows``, as the scrape and ``canary report`` read it), a
window costs Python per archive row each second: about 1,450 rows for the bench's four
shared classes, most of a later evaluation's cost. Kept, an evaluation reads only the
rows after its mark, newest first as the fresh read does, keeps those at or before the
new mark and counts the younger ones (a few seconds of them) for this evaluation alone,
then drops the kept rows that left the span or fell behind the window's cut. The mark
trails the database's clock as the ledger's does (``ledger.SETTLE``): a row's
``dateModified`` is its writer's clock and its commit may come later, so a younger row
could still appear behind it. A row that appears further behind the mark, or leaves
the archive within the window, is what a fresh read would see and this does not.

A dropped row is never needed again: the span's start only moves forward (a start
further back reads the window afresh), and so does the cut (the newest rows where the
new side has ``max_runs`` runs or the old side four times that), since the archive only
grows at its newest end.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sqlalchemy import Connection

from bridge.canary import sql
from bridge.queue.model import RESULT_SUCCESS, label_of

MICROSECONDS = 1_000_000  # the archive's ``duration`` unit
PAGE_ROWS = 1000  # archive rows read at a time, newest first (``newest_first``)

Key = tuple[str | None, int]  # an archive row's label and result
# (level, label, result, earlier failures) -> the runs one row counts on the new side
# and on the old side (the guard's rules, ``guard._row_runs``).
Weigh = Callable[[str, str | None, int, int], tuple[int, int]]


class _Row(NamedTuple):
    """One archive row of a window, as its sums need it."""

    modified: int
    key: Key
    failures: int
    duration: float | None  # a success's, in seconds
    new: int  # its runs on the new side, at the window's level
    old: int  # and on the old side


@dataclass(frozen=True)
class Found:
    """One window's archive rows, summed: from ``start`` (the span's start, or the
    second of the row where it was cut), per label and result their rows and earlier
    failures, and the successes' durations (seconds, unordered)."""

    start: int
    counts: dict[Key, list[int]]
    durations: dict[Key, list[float]]


@dataclass
class _Kept:
    """One (class, level)'s kept rows, oldest first as the archive orders them
    (``dateModified``, ``id``), and their sums."""

    start: int  # the span's start it was last read for: an earlier one reads afresh
    rows: deque[_Row] = field(default_factory=deque)
    counts: dict[Key, list[int]] = field(default_factory=dict)
    durations: dict[Key, list[float]] = field(default_factory=dict)  # each sorted
    new: int = 0
    old: int = 0

    def add(self, row: _Row) -> None:
        self.rows.append(row)
        self.new += row.new
        self.old += row.old
        _count(self.counts, row, 1)
        if row.duration is not None:
            bisect.insort(self.durations.setdefault(row.key, []), row.duration)

    def drop_oldest(self) -> None:
        row = self.rows.popleft()
        self.new -= row.new
        self.old -= row.old
        _count(self.counts, row, -1)
        if row.duration is not None:
            durations = self.durations[row.key]
            del durations[bisect.bisect_left(durations, row.duration)]
            if not durations:
                del self.durations[row.key]


def _count(counts: dict[Key, list[int]], row: _Row, sign: int) -> None:
    """``row`` added to ``counts`` (``sign`` -1: taken out; a key left with no row goes)."""
    summed = counts.setdefault(row.key, [0, 0])
    summed[0] += sign
    summed[1] += sign * row.failures
    if not summed[0]:
        del counts[row.key]


@dataclass
class _Read:
    """One window's read at an evaluation: the rows from ``since`` on, newest first,
    until it reaches them all or its cut."""

    task_class: str
    level: str
    since: int
    kept: _Kept
    fresh: list[_Row] = field(default_factory=list)  # newest first
    new: int = 0
    old: int = 0
    complete: bool = False

    def take(self, row: Any, label: str | None, caps: tuple[int, int], weigh: Weigh) -> None:
        if row.dateModified < self.since:  # older than what it reads, as all after
            self.complete = True
            return
        new, old = weigh(self.level, label, row.result, row.failureCount)
        duration = row.duration / MICROSECONDS if row.result == RESULT_SUCCESS else None
        self.fresh.append(
            _Row(row.dateModified, (label, row.result), row.failureCount, duration, new, old)
        )
        self.new, self.old = self.new + new, self.old + old
        if self.new >= caps[0] or self.old >= caps[1]:  # cut: the older rows are behind it
            self.complete = True

    def settle(self, start: int, mark: int, caps: tuple[int, int]) -> Found:
        """The window from ``start``: the kept rows from ``start`` on, and the rows read,
        those at or before ``mark`` kept from now on, cut where the newest of them reach
        ``caps`` (the kept rows behind the cut dropped)."""
        kept = self.kept
        while kept.rows and kept.rows[0].modified < start:
            kept.drop_oldest()
        young = []
        for row in reversed(self.fresh):
            if row.modified <= mark:
                kept.add(row)
            else:
                young.append(row)
        new, old = sum(row.new for row in young), sum(row.old for row in young)
        if kept.new + new >= caps[0] or kept.old + old >= caps[1]:
            # The oldest row goes while the rows after it still reach a cap: the window
            # starts at the row where reading newest first reached it.
            while kept.rows and (
                kept.new - kept.rows[0].new + new >= caps[0]
                or kept.old - kept.rows[0].old + old >= caps[1]
            ):
                kept.drop_oldest()
            start = (kept.rows[0] if kept.rows else young[0]).modified
        counts = {key: list(both) for key, both in kept.counts.items()}
        durations = {key: list(each) for key, each in kept.durations.items()}
        for row in young:
            _count(counts, row, 1)
            if row.duration is not None:
                durations.setdefault(row.key, []).append(row.duration)
        return Found(start, counts, durations)


@dataclass
class ShortWindows:
    """The short windows of the (class, level) pairs the guard judged at its last
    evaluation: their rows archived up to ``mark``."""

    mark: int | None = None
    _kept: dict[tuple[str, str], _Kept] = field(default_factory=dict)

    def windows(
        self,
        conn: Connection,
        asked: Sequence[tuple[str, str, int]],
        now: int,
        mark: int,
        caps: tuple[int, int],
        weigh: Weigh,
    ) -> list[Found]:
        """For each ``(task_class, level, seconds)`` of ``asked`` (each pair once), its
        archive rows of the last ``seconds`` before ``now`` (the database's clock), cut
        where the newest reach ``caps`` (the new side's runs, the old side's): the kept
        rows, and those archived after the last mark, read in one pass for all, newest
        first; the rows up to ``mark`` are kept for the next evaluation, the pairs not
        asked forgotten."""
        mark = mark if self.mark is None else max(mark, self.mark)  # a clock set back
        reads = []
        for task_class, level, seconds in asked:
            start, kept = now - seconds, self._kept.get((task_class, level))
            if kept is None or self.mark is None or start < kept.start:
                kept, since = _Kept(start), start
            else:
                kept.start, since = start, max(start, self.mark + 1)
            reads.append(_Read(task_class, level, since, kept))
        _read(conn, reads, caps, weigh)
        found = [
            read.settle(now - seconds, mark, caps)
            for read, (_, _, seconds) in zip(reads, asked, strict=True)
        ]
        self.mark = mark
        self._kept = {(read.task_class, read.level): read.kept for read in reads}
        return found


def newest_first(
    conn: Connection, still_read: Callable[[], Sequence[tuple[str, int]]]
) -> Iterator[Any]:
    """The archive rows of the ``(task_class, since)`` still read, newest first, a page
    at a time of those still read when the page is asked for (``still_read``, called
    anew), until none is or the archive has no older row: one statement serves every
    class, since the archive's only usable index, ``dateModified``, has none."""
    before: tuple[int, int] | None = None
    while asked := still_read():
        classes = sorted({task_class for task_class, _ in asked})
        since = min(since for _, since in asked)
        rows = conn.execute(sql.archived_runs(classes, since, PAGE_ROWS, before)).all()
        yield from rows
        if len(rows) < PAGE_ROWS:
            return
        before = (rows[-1].dateModified, rows[-1].id)


def _read(conn: Connection, reads: list[_Read], caps: tuple[int, int], weigh: Weigh) -> None:
    """The archive rows of the reads onto them, newest first, until each is complete."""
    by_class: dict[str, list[_Read]] = {}
    for read in reads:
        by_class.setdefault(read.task_class, []).append(read)

    def pending() -> list[tuple[str, int]]:
        return [(read.task_class, read.since) for read in reads if not read.complete]

    for row in newest_first(conn, pending):
        label = label_of(row.leaseOwner)
        for read in by_class[row.taskClass]:
            if not read.complete:
                read.take(row, label, caps, weigh)
