"""The guard's long window: each shared class's archived runs of the last
``BRIDGE_CANARY_HISTORY`` s, summed per minute, by who ran them and how they ended.

A small difference at low traffic (3% failing against 1%, a class at one task a second
and a 5% share) needs thousands of new-side runs, hours of them, to be told from chance;
reading hours of archive rows each second is not affordable (the archive's only usable
index is ``dateModified``, so a window reads every class's rows of its span). The
ledger is kept in the guard's process instead: the first evaluation of the classes sums
their history in one grouped statement, and each later one adds the minutes of the rows
archived since the previous (a few seconds of rows, every class's in one statement),
then forgets the minutes that left the span.

A row is added once it is ``SETTLE`` s old: its ``dateModified`` is its writer's clock
(PHP's ``time()`` on a phd host) and its transaction may commit after that second, so a
younger row could still appear behind the ledger's mark.

The ledger keeps the short window's rows too (``short_window``), on the same mark, so
that the process that judges keeps all it reads of the archive in one object.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection

from bridge.canary import sql
from bridge.canary.short_window import Found, ShortWindows, Weigh
from bridge.canary.sql import MINUTE

SETTLE = 5

Counts = dict[tuple[str | None, int], list[int]]  # (label, result) -> [rows, failures]


def add_counts(into: Counts, counts: Counts, sign: int = 1) -> None:
    """``counts`` added to ``into`` (``sign`` -1: taken out; a key left with no row goes)."""
    for key, (rows, failures) in counts.items():
        summed = into.setdefault(key, [0, 0])
        summed[0] += sign * rows
        summed[1] += sign * failures
        if not summed[0]:
            del into[key]


@dataclass
class Minutes:
    """A class's runs of the span per minute, and their sum, kept so that a long window
    with fewer runs than its cut is its sum less a few old minutes, not a day of them
    added up at each evaluation."""

    upto: int  # rows archived at or before this second are summed
    by_minute: dict[int, Counts] = field(default_factory=dict)  # oldest minute first
    total: Counts = field(default_factory=dict)

    def add(self, minute: int, key: tuple[str | None, int], rows: int, failures: int) -> None:
        """One grouped row of the archive, onto its minute and the sum."""
        for counts in (self.by_minute.setdefault(minute, {}), self.total):
            summed = counts.setdefault(key, [0, 0])
            summed[0] += rows
            summed[1] += failures

    def newest_first(self) -> Iterator[tuple[int, Counts]]:
        return reversed(self.by_minute.items())

    def summed_from(self, first: int) -> Counts:
        """The sum of the minutes from ``first`` on."""
        summed = {key: list(both) for key, both in self.total.items()}
        for minute, counts in self.by_minute.items():
            if minute >= first:
                break
            add_counts(summed, counts, -1)
        return summed

    def forget_before(self, first: int) -> None:
        """The minutes before ``first`` gone, from the sum too."""
        while self.by_minute and (oldest := next(iter(self.by_minute))) < first:
            add_counts(self.total, self.by_minute.pop(oldest), -1)


@dataclass
class Ledger:
    """The summed runs of each class the guard judged, over the last ``span`` s, and the
    rows of its short windows."""

    span: int
    _kept: dict[str, Minutes] = field(default_factory=dict)
    _short: ShortWindows = field(default_factory=ShortWindows)

    def short_windows(
        self,
        conn: Connection,
        asked: Sequence[tuple[str, str, int]],
        now: int,
        caps: tuple[int, int],
        weigh: Weigh,
    ) -> list[Found]:
        """:meth:`ShortWindows.windows` of ``asked`` at ``now`` (the database's clock),
        the rows up to ``now`` less ``SETTLE`` kept."""
        return self._short.windows(conn, asked, now, now - SETTLE, caps, weigh)

    def minutes(
        self, conn: Connection, task_classes: Sequence[str], now: int
    ) -> dict[str, Minutes]:
        """The minutes of the span of each of ``task_classes``, brought up to ``now``
        (the database's clock) less ``SETTLE``: one grouped statement for the classes
        summed up to the same second (all of them but at a class's first evaluation); a
        class unseen for longer than the span is summed afresh."""
        oldest, upto = now - self.span, now - SETTLE
        behind: dict[int, list[str]] = {}
        for task_class in task_classes:
            kept = self._kept.get(task_class)
            if kept is None or kept.upto < oldest:
                kept = self._kept[task_class] = Minutes(oldest)
            if upto > kept.upto:
                behind.setdefault(kept.upto, []).append(task_class)
        for after, classes in behind.items():
            rows = conn.execute(sql.minute_runs(classes, after, upto)).all()
            for row in sorted(rows, key=lambda r: int(r.minute)):
                key = (row.label, int(row.result))
                self._kept[row.taskClass].add(
                    int(row.minute), key, int(row.rows), int(row.failures)
                )
            for task_class in classes:
                self._kept[task_class].upto = upto
        for task_class in task_classes:
            self._kept[task_class].forget_before(oldest // MINUTE)
        return {task_class: self._kept[task_class] for task_class in task_classes}
