"""A message the broker delivers a second time: its leases go back, unless their run lives.

Messages are acked when their run ends (``acks_late``), so the broker hands a message to
another consumer at once when its worker dies: a prefork child (Celery's parent rejects
it, ``reject_on_worker_lost``), a whole worker or a threads worker (its connection
closes), a host (the broker's heartbeat gives up on it). The same redelivery follows a
mere loss of the broker connection (a partition, a broker restart), where the run goes
on. The broker cannot tell the two apart; the database can: a live run holds its
lease's run lock (``bridge.queue.run_locks``), on a session the server ends with its
process. So a redelivered copy never runs its tasks itself (a second run under the same
lease): for each one whose lock is free it hands the lease back, fenced as every write
(owner, failure count, unexpired), and the next poll leases it anew; one whose lock a
live run holds is left to that run and its lease.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bridge.engine.context import Runtime
from bridge.queue import Lease
from bridge.queue.model import Leased
from bridge.queue.run_locks import RunLocks
from bridge.queue.session import LeaseSession, handed_back

# Seconds a copy waits for the first lock: the server frees a dead process's locks a
# moment after its connection closed, which may be after the broker redelivered.
PROBE_WAIT = 2.0


@dataclass(frozen=True)
class Redelivery:
    """What a redelivered copy did with each of its tasks."""

    handed_back: list[int] = field(default_factory=list)  # no live run: leased anew
    running: list[int] = field(default_factory=list)  # a live run holds it: left alone
    done: list[int] = field(default_factory=list)  # the lease had ended (run, freed)

    def describe(self) -> str:
        parts = [
            f"{len(ids)} {what} ({', '.join(f'#{i}' for i in ids)})"
            for what, ids in (
                ("handed back", self.handed_back),
                ("still running elsewhere", self.running),
                ("no longer leased", self.done),
            )
            if ids
        ]
        return "redelivered: " + "; ".join(parts)


def hand_back_redelivered(rt: Runtime, owner: str, items: Sequence[Leased]) -> Redelivery:
    """Hand back the leases of a redelivered message whose run is not alive."""
    leases = [Lease(item.id, owner, item.failure_count) for item in items]
    return hand_back_unrun(rt.runs, rt.queue.session, leases, PROBE_WAIT)


def hand_back_unrun(
    runs: RunLocks, session: LeaseSession, leases: Sequence[Lease], wait: float
) -> Redelivery:
    """Hand back each of ``leases`` whose run lock is free (``wait``: seconds for the
    first), fenced; the lock is held through the write, so no run starts meanwhile."""
    held = runs.hold(leases, wait=wait)
    free = [lease for lease, ok in zip(leases, held, strict=True) if ok]
    try:
        written = session.apply([handed_back(lease) for lease in free]) if free else []
    finally:
        runs.release(free)
    back = {lease.task_id for lease, ok in zip(free, written, strict=True) if ok}
    redelivery = Redelivery()
    for lease, ok in zip(leases, held, strict=True):
        into = redelivery.running if not ok else redelivery.handed_back
        (into if not ok or lease.task_id in back else redelivery.done).append(lease.task_id)
    return redelivery
