"""How many leases a queue may hold at once, so that a backlog's order stays Phorge's.

Phorge runs smaller priority numbers first. Once a task is in the broker, its place is
fixed: the broker is first in, first out (SQLite has no priorities; RabbitMQ's need a
queue declared with them, which an existing install refuses). So a queue holds only
what its workers start within about ``ahead`` seconds (``BRIDGE_DISPATCH_AHEAD``), and
the rest of the backlog waits in the database, where the next poll leases by priority.

The workers' pace comes from the archive (:meth:`PhorgeQueue.recent_runs`): its rate
``r`` and mean duration ``d`` give the slots in use, ``r·d`` (Little's law). A queue
holds ``1.25·r·d + r·ahead`` leases: the busy slots with room to find more, and one
interval's starts. Tasks so short that ``ahead / d`` is larger may fill up to that
(waiting behind them costs less than ``ahead`` even on one slot), once the window holds
:data:`SHORT_EVIDENCE` runs, so no-op work is not slowed. With no history a queue starts
with :data:`FLOOR`, and grows as runs archive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bridge.queue.model import RecentRuns

FLOOR = 2  # leases of a queue with no recent runs: two slots, one task each
HEADROOM = 1.25  # busy slots x this: a saturated queue finds a freed slot; 1 s tasks on
# two slots hold at most one waiting task
WINDOW = 10  # seconds of archive the pace is read from: long tasks need several runs
MIN_COST = 0.0005  # seconds a task costs a worker beyond its archived duration
# Runs of the window before their mean may fill a queue past its busy slots: a few short
# runs (a class that is sometimes quick) must not send a backlog of slow ones at once.
SHORT_EVIDENCE = 64
# Messages an unpaced queue's leases are spread over at least: as many processes or
# threads as this can start at once.
SPREAD = 32
# A paced queue's: four a busy slot (one running, one reserved, and as many again for
# idle slots, which the next poll measures busy: two a slot stalled 16 processes of
# 10 ms tasks at about half of them), and at least this many. Few, larger messages:
# each one costs the worker about as much CPU as a short task.
PACED_SPREAD = 8
SPREAD_PER_BUSY_SLOT = 4


@dataclass(frozen=True)
class Pace:
    """A queue's measured pace: completions a second and mean seconds a run."""

    rate: float
    mean: float
    runs: int

    @classmethod
    def of(cls, runs: RecentRuns) -> Pace | None:
        if runs.count == 0:
            return None
        return cls(runs.count / runs.span, runs.duration_us / runs.count / 1e6, runs.count)

    @property
    def busy(self) -> float:
        """Worker slots in use (Little's law)."""
        return self.rate * self.mean

    def in_flight(self, ahead: float) -> int:
        """Leases that keep the busy slots fed until about ``ahead`` seconds from now."""
        fed = math.floor(HEADROOM * self.busy + self.rate * ahead)
        short = int(ahead / max(self.mean, MIN_COST)) if self.runs >= SHORT_EVIDENCE else 0
        return max(FLOOR, fed, short)

    def message_size(self, in_flight: int, ahead: float, batch_max: int) -> int:
        """Tasks one message carries: the leases spread over
        :data:`SPREAD_PER_BUSY_SLOT` messages a busy slot, at least :data:`PACED_SPREAD`,
        and at most ``ahead`` seconds of work, since a worker holding a message starts
        nothing else until it is through."""
        spread = in_flight // max(PACED_SPREAD, SPREAD_PER_BUSY_SLOT * math.ceil(self.busy))
        return max(1, min(batch_max, spread, int(ahead / max(self.mean, MIN_COST))))


def in_flight_target(pace: Pace | None, ahead: float | None, limit: int) -> int:
    """Leases a queue may hold: ``limit`` (``BRIDGE_MAX_INFLIGHT``) when pacing is off."""
    if ahead is None:
        return limit
    return min(limit, FLOOR if pace is None else pace.in_flight(ahead))
