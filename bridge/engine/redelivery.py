"""A message the broker delivers a second time: its leases go back, unless their run lives.

Messages are acked when their run ends (``acks_late``), so the broker hands a message to
another consumer at once when its worker dies: a prefork child (Celery's parent rejects
it, ``reject_on_worker_lost``), a whole worker or a threads worker (its connection
closes), a host (the broker's heartbeat gives up on it). The same redelivery follows a
mere loss of the broker connection (a partition, a broker restart), where the run goes
on. The broker cannot tell the two apart; the database can: a live run holds its
task's run lock (``bridge.queue.run_locks``), on a session the server ends with its
process. So a redelivered copy never runs its tasks itself (a second run under the same
lease): for each one whose lock is free it hands the lease back, fenced as every write
(owner, failure count, unexpired), and the next poll leases it anew; one whose lock a
live run holds is left to that run and its lease.

A lease that was a new-side run of a class a canary shares (a native handler's
share, the bridge's share of phd's class) falls back instead: the row goes to the old
side for good, due at once, and the guard counts the death as the new side's failure
(a crash is evidence, and the row does not go back to the side that died on it). Beat's
rescue of a dead worker's fetched messages on Redis (``bridge.runtime.rescue``) decides
the same, with :func:`new_side_runs`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from bridge.engine.context import Runtime
from bridge.engine.sides import choose
from bridge.queue import Lease
from bridge.queue.model import Leased
from bridge.queue.run_locks import RunLocks
from bridge.queue.session import LeaseSession, fell_back, handed_back

# Seconds a copy waits for the first lock: the server frees a dead process's locks a
# moment after its connection closed, which may be after the broker redelivered.
PROBE_WAIT = 2.0


@dataclass(frozen=True)
class Redelivery:
    """What a redelivered copy did with each of its tasks."""

    handed_back: list[int] = field(default_factory=list)  # no live run: leased anew
    running: list[int] = field(default_factory=list)  # a live run holds it: left alone
    done: list[int] = field(default_factory=list)  # the lease had ended (run, freed)
    fell_back: list[int] = field(default_factory=list)  # of those handed back: old side

    def describe(self) -> str:
        parts = [
            f"{len(ids)} {what} ({', '.join(f'#{i}' for i in ids)})"
            for what, ids in (
                ("handed back", [i for i in self.handed_back if i not in self.fell_back]),
                ("fallen back to the old side", self.fell_back),
                ("still running elsewhere", self.running),
                ("no longer leased", self.done),
            )
            if ids
        ]
        return "redelivered: " + "; ".join(parts)


def new_side_runs(rt: Runtime, items: Sequence[Leased]) -> set[int]:
    """The ids of ``items`` whose run was the new side's of a shared class (``choose``:
    it had a side to fall back to)."""
    canary = rt.canary.current()
    return {
        item.id
        for item in items
        if item.task_class is not None
        and choose(rt.registry, canary, item.task_class, item.id, None).fallback_to is not None
    }


def hand_back_redelivered(rt: Runtime, owner: str, items: Sequence[Leased]) -> Redelivery:
    """Hand back the leases of a redelivered message whose run is not alive; a new-side
    run of a shared class falls back."""
    leases = [Lease(item.id, owner, item.failure_count) for item in items]
    return hand_back_unrun(rt.runs, rt.queue.session, leases, PROBE_WAIT, new_side_runs(rt, items))


def hand_back_unrun(
    runs: RunLocks,
    session: LeaseSession,
    leases: Sequence[Lease],
    wait: float,
    fall_back: Collection[int] = (),
) -> Redelivery:
    """Hand back each of ``leases`` whose run lock is free (``wait``: seconds for the
    first), fenced, those of ``fall_back`` (task ids) as fallbacks; the lock is held
    through the write, so no run starts meanwhile."""
    held = runs.hold(leases, wait=wait)
    free = [lease for lease, ok in zip(leases, held, strict=True) if ok]
    writes = [
        fell_back(lease) if lease.task_id in fall_back else handed_back(lease) for lease in free
    ]
    try:
        written = session.apply(writes) if free else []
    finally:
        runs.release(free)
    back = {lease.task_id for lease, ok in zip(free, written, strict=True) if ok}
    redelivery = Redelivery(fell_back=sorted(back & set(fall_back)))
    for lease, ok in zip(leases, held, strict=True):
        into = redelivery.running if not ok else redelivery.handed_back
        (into if not ok or lease.task_id in back else redelivery.done).append(lease.task_id)
    return redelivery
