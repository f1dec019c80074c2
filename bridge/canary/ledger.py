"""The guard's long window: each shared class's archived runs of the last
``BRIDGE_CANARY_HISTORY`` s, summed per minute, by who ran them and how they ended.

A small difference at low traffic (3% failing against 1%, a class at one task a second
and a 5% share) needs thousands of new-side runs, hours of them, to be told from chance;
reading hours of archive rows each second is not affordable (the archive's only usable
index is ``dateModified``, so a window reads every class's rows of its span). The
ledger is kept in the guard's process instead: the first evaluation of a class sums its
history in one grouped statement, and each later one adds the minutes of the rows
archived since the previous (a few seconds of rows), then forgets the minutes that left
the span.

A row is added once it is ``SETTLE`` s old: its ``dateModified`` is its writer's clock
(PHP's ``time()`` on a phd host) and its transaction may commit after that second, so a
younger row could still appear behind the ledger's mark.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from sqlalchemy import Connection

from bridge.canary import sql
from bridge.canary.sql import MINUTE

SETTLE = 5

Counts = dict[tuple[str | None, int], list[int]]  # (label, result) -> [rows, failures]


@dataclass
class _Kept:
    upto: int  # rows archived at or before this second are summed
    minutes: dict[int, Counts] = field(default_factory=dict)  # oldest minute first


@dataclass
class Ledger:
    """The summed runs of each class the guard judged, over the last ``span`` s."""

    span: int
    _kept: dict[str, _Kept] = field(default_factory=dict)

    def minutes(self, conn: Connection, task_class: str, now: int) -> Iterator[tuple[int, Counts]]:
        """``task_class``'s minutes of the span, newest first, brought up to ``now``
        (the database's clock) less ``SETTLE``; a class unseen for longer than the span
        is summed afresh."""
        oldest = now - self.span
        kept = self._kept.get(task_class)
        if kept is None or kept.upto < oldest:
            kept = self._kept[task_class] = _Kept(oldest)
        upto = now - SETTLE
        if upto > kept.upto:
            rows = conn.execute(sql.minute_runs(task_class, kept.upto, upto)).all()
            for row in sorted(rows, key=lambda r: int(r.minute)):
                counts = kept.minutes.setdefault(int(row.minute), {})
                summed = counts.setdefault((row.label, int(row.result)), [0, 0])
                summed[0] += int(row.rows)
                summed[1] += int(row.failures)
            kept.upto = upto
        while kept.minutes and next(iter(kept.minutes)) < oldest // MINUTE:
            del kept.minutes[next(iter(kept.minutes))]
        return reversed(kept.minutes.items())
