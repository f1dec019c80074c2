"""One poll of Phorge's queue: lease due rows per Celery queue, up to its in-flight target.

Each queue leases only up to its own target (its measured pace, see
:mod:`bridge.engine.pace`, at most ``max_inflight``, minus the leases the bridge holds
for its classes), so a flood in one queue never starves another, and a backlog waits in
the database in Phorge's priority order rather than in the broker's. One poll runs at a
time (a database lock; an overlapping poll returns at once), so two polls never both
fill the same capacity. A dispatch marks one message (:func:`_repoll_at`): when it has
run, the worker asks for a poll at once, so throughput is not capped at
``target / poll_interval``.

Sending is the caller's (:class:`Send`): the Celery runtime publishes messages, the
benchmark's SQL loop runs them in process. While the database refuses writes the lease
is refused too: the write gate closes (logged once), and each poll then only probes
until writes are accepted again, so the gate of an idle worker reopens too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Protocol

from bridge.canary.weights import SCALE, Canary
from bridge.engine.context import Runtime
from bridge.engine.pace import SPREAD, WINDOW, Pace, in_flight_target
from bridge.errors import WritesRefused
from bridge.handlers.api import Handler
from bridge.handlers.capabilities import is_available
from bridge.queue.implementations import CELERY
from bridge.queue.model import InFlight, Leased

# Seconds a poll's lease lasts until the broker took its messages (then the dispatch
# lease): sending takes milliseconds, and a poll killed before it leaves its rows this
# long, not the dispatch lease (a message sent late finds its lease gone and runs none).
SEND_LEASE = 15


class Send(Protocol):
    def __call__(
        self,
        owner: str,
        tasks: Sequence[Leased],
        queue: str,
        size: int,
        repoll_at: int | None = None,
    ) -> int:
        """Send ``tasks`` (leased by ``owner``) to ``queue``, ``size`` a message; returns
        how many were sent before any error. Message number ``repoll_at`` (from 0) asks
        for a poll once it has run."""
        ...


def batch_size(in_flight: int, batch_max: int) -> int:
    """Tasks a message carries for a queue holding ``in_flight`` leases (this dispatch's
    included): one each below ``2 * SPREAD``, else enough to make ``SPREAD`` messages of
    them, at most ``batch_max``.

    A message costs the worker about as much CPU as a short task's own work, so a
    backlog shares it; a light load keeps one message per Phorge task (Flower shows
    each one's state), and a queue at its capacity holds about ``SPREAD`` messages
    whatever the poll interval, so up to that many processes or threads are busy.
    """
    return max(1, min(batch_max, in_flight // SPREAD))


# Whether another live worker consumes a Celery queue and would run a task class there:
# the fleet's view (``bridge.runtime.announce``), for ``(task_class, queue)``.
RunsElsewhere = Callable[[str, str], bool]


def plan(rt: Runtime, elsewhere: RunsElsewhere | None = None) -> dict[str, list[str]]:
    """Task classes present in the queue that the fleet can run now, grouped by the
    Celery queue serving them.

    The poll runs in any worker, so what this process can run is not the whole story
    (``elsewhere``: what the other live workers announced). A class is leased when:

    - its handler here is available (``capabilities.is_available``, asked once per
      handler and poll);
    - it has no handler here (a control worker without PHP) and another worker consuming
      its queue runs it;
    - its transport is down here (the PHP runner cannot boot, Conduit is unavailable),
      this worker can run nothing of its queue (it stands by on it,
      ``Outages.standby_queues``, computed once a poll after every handler was asked),
      and another worker runs it. A worker that still serves some of the queue goes by
      its own transports, so a fleet whose Conduit is down everywhere does not lease, in
      the seconds before their announcements say so, what every worker would hand back.
    """
    router, registry = rt.settings.router, rt.registry
    present = rt.queue.task_classes()
    served: dict[str, Handler | None] = {c: registry.handler_for(c) for c in present}
    available: dict[int, bool] = {}
    for handler in served.values():
        if handler is not None and id(handler) not in available:
            available[id(handler)] = is_available(handler)
    standby: dict[str, float] = {}
    if elsewhere is not None and not all(available.values()):
        standby = rt.outages.standby_queues(present)
    by_queue: dict[str, list[str]] = defaultdict(list)
    for task_class, handler in served.items():
        queue = router.queue_for(task_class)
        here = handler is not None and available[id(handler)]
        others = handler is None or queue in standby
        if here or (others and elsewhere is not None and elsewhere(task_class, queue)):
            by_queue[queue].append(task_class)
    return by_queue


def bridge_shares(
    canary: Canary, by_queue: dict[str, list[str]]
) -> tuple[dict[str, list[str]], dict[str, int]]:
    """``by_queue`` without the classes the canary gives wholly to phd (celery weight 0),
    and the bridge's weight (basis points) of each class it shares with phd: the poll
    leases only the rows of those that never failed and whose bucket is below it."""
    kept: dict[str, list[str]] = {}
    shares: dict[str, int] = {}
    for queue, classes in by_queue.items():
        ours = []
        for task_class in classes:
            weight = canary.weight(task_class, CELERY)
            if weight <= 0:
                continue
            if weight < SCALE:
                shares[task_class] = weight
            ours.append(task_class)
        if ours:
            kept[queue] = ours
    return kept, shares


def poll_once(rt: Runtime, send: Send, elsewhere: RunsElsewhere | None = None) -> int:
    """One poll; returns how many tasks were dispatched (0 when another poll is running).

    Under a canary (``rt.canary``), a class is leased only for the bridge's share
    of it (:func:`bridge_shares`); without one, the statements are exactly as before."""
    settings = rt.settings
    with rt.queue.poll_lock(settings.owner_prefix) as now:
        if now is None:
            return 0
        if not rt.writes.is_open and not rt.writes.wait_open(0):
            return 0  # one probe a poll while writes are refused: nothing to lease
        by_queue = plan(rt, elsewhere)
        canary = rt.canary.current()
        shares: dict[str, int] = {}
        if canary.active:
            by_queue, shares = bridge_shares(canary, by_queue)
        served = [c for classes in by_queue.values() for c in classes]
        # An idle queue (the usual case between bursts) skips the capacity count.
        in_flight = rt.queue.in_flight_by_class(settings.owner_prefix, served) if served else {}
        sent = 0
        for queue, classes in by_queue.items():
            try:
                held = [in_flight[c] for c in classes if c in in_flight]
                sent += fill(rt, send, queue, held, classes, now, shares)
            except WritesRefused as exc:
                rt.writes.refused(exc)  # logged once; each poll probes until it ends
                return sent
        return sent


def fill(
    rt: Runtime,
    send: Send,
    queue: str,
    leases: list[InFlight],
    classes: list[str],
    now: int,
    shares: dict[str, int] | None = None,
) -> int:
    """Lease and send what ``queue`` may take now (see :mod:`bridge.engine.pace`);
    ``shares``: the bridge's weights of classes it shares with phd (:func:`bridge_shares`).

    A queue at its pace still takes rows more urgent than every lease it holds (the
    urgent lane: as many as it has busy slots, a message each), so a mail is not left
    in the database until a flood of imports drains.
    """
    settings = rt.settings
    limit, ahead = settings.max_inflight.for_queue(queue), settings.dispatch_ahead
    in_flight = sum(h.count for h in leases)
    pace = None if ahead is None else Pace.of(rt.queue.recent_runs(classes, WINDOW))
    target = in_flight_target(pace, ahead, limit)
    urgent = in_flight >= target
    if urgent:
        if in_flight >= limit or not leases:
            return 0
        wanted = min(limit - in_flight, max(1, round(pace.busy) if pace else 1))
    else:
        wanted = target - in_flight
    # Leased for a moment, then for the dispatch lease once sent: a poll that dies in
    # between (its worker killed) leaves rows due again within SEND_LEASE seconds.
    first_lease = min(settings.dispatch_lease, SEND_LEASE)
    owner, tasks = rt.queue.lease_to_send(
        wanted,
        settings.owner_prefix,
        first_lease,
        classes,
        settings.inline_data_max,
        now=now,
        priority_below=max(h.worst_priority for h in leases) if urgent else None,
        shares=shares,
    )
    if not tasks:
        return 0
    if urgent:
        size, repoll_at = 1, None
    else:
        if pace is not None and ahead is not None:
            size = pace.message_size(in_flight + len(tasks), ahead, settings.batch_max)
        else:
            size = batch_size(in_flight + len(tasks), settings.batch_max)
        repoll_at = _repoll_at(len(tasks), size, target, paced=ahead is not None)
    done = send(owner, tasks, queue, size, repoll_at=repoll_at)
    if done and settings.dispatch_lease > first_lease:
        rt.queue.extend_sent([t.id for t in tasks[:done]], owner, settings.dispatch_lease)
    if done < len(tasks):
        # The broker refused: hand the unsent leases back at once rather than letting
        # them wait out the dispatch lease.
        rt.queue.free_own([t.id for t in tasks[done:]], owner)
    return done


def _repoll_at(leased: int, size: int, target: int, paced: bool) -> int | None:
    """Which message of a dispatch asks for a poll once run: its middle one. Paced, every
    dispatch's: a paced queue holds about a poll interval of work, so a refill must be
    on its way before it drains. Unpaced, only a dispatch of half the target or more
    (half the target is free by then), so at most one such chain of polls lives."""
    if not paced and leased < max(1, target // 2):
        return None
    return -(-leased // size) // 2
