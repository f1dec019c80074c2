"""Rescue on Redis: the leases of messages a dead worker had fetched.

RabbitMQ requeues a consumer's unacked messages when its connection ends, and their
copies hand the dead runs' leases back (``bridge.engine.redelivery``). Redis does not:
kombu keeps a fetched, unacked message in its ``unacked`` hash until a live consumer
restores it, after ``visibility_timeout`` (an hour here, since a long run must not be
delivered twice). So a worker ``kill -9``ed, OOM-killed or on a lost host would leave
its runs' leases for the dispatch lease.

The beat holding the beat lock looks at that hash every :data:`LOOK_EVERY` seconds. A
lease in it whose run lock (``bridge.queue.run_locks``) was free on every look for
:data:`FREE_FOR` seconds is handed back, fenced, and a poll asked for. Messages are
acked when their run ends and a worker fetches no more than it runs (prefetch 1 a
process), so a fetched message's lock is free only for the moment before its run
starts, or once its process died (the server frees the locks at once) or its host was
cut off from the database past the session's ``wait_timeout``. A message handed back
before it started finds its lease gone when it does, and runs nothing; the copies Redis
restores an hour later find their leases ended.

A dead new-side run of a class a canary shares falls back instead, as a
redelivered copy's does (``bridge.engine.redelivery.new_side_runs``: the class its
message names, by the registry and weights of this process's runtime).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from celery import Celery
from kombu.utils.json import loads
from sqlalchemy import Engine

from bridge import assembly
from bridge.engine.context import Runtime
from bridge.engine.redelivery import hand_back_unrun, new_side_runs
from bridge.queue import Lease, PhorgeQueue
from bridge.queue.model import Leased
from bridge.queue.run_locks import RunLocks
from bridge.runtime.dispatch import EXECUTE_BATCH, EXECUTE_TASK

log = logging.getLogger(__name__)

LOOK_EVERY = 2.0  # seconds between two looks at the fetched messages
FREE_FOR = 4.0  # seconds a fetched lease's lock must stay free before it is handed back
POLL_TASK = "bridge.poll"


def leases_of(name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[Lease, Leased]:
    """The leases an execute message carries (``bridge.runtime.dispatch``), each with its
    task as the message names it (its class tells whether a dead run falls back)."""
    if name == EXECUTE_TASK:
        task_id, owner, failure_count = args[:3]
        items = [Leased(int(task_id), int(failure_count), kwargs.get("task_class"))]
    elif name == EXECUTE_BATCH:
        owner, tasks = args[:2]
        items = [Leased(int(task[0]), int(task[1]), task[2]) for task in tasks]
    else:
        return {}
    return {Lease(item.id, str(owner), item.failure_count): item for item in items}


def fetched_leases(channel: Any) -> dict[Lease, Leased]:
    """The leases of every execute message some consumer fetched and has not acked, from
    kombu's Redis ``unacked`` hash (each entry: the message, its exchange and routing key)."""
    found: dict[Lease, Leased] = {}
    for raw in channel.client.hvals(channel.unacked_key):
        try:
            payload, _, _ = loads(raw)
            message = channel.Message(payload, channel=channel)
            name = message.headers.get("task", "")
            if name in (EXECUTE_TASK, EXECUTE_BATCH):
                args, kwargs, _embed = message.decode()
                found.update(leases_of(name, args, kwargs))
        except Exception as exc:  # someone else's message, or one we cannot read
            log.debug("rescue: an unacked message not read: %s", exc)
    return found


class FreeSince:
    """When each fetched lease's run lock was first seen free, on this run of looks."""

    def __init__(self) -> None:
        self._since: dict[Lease, float] = {}

    def due(self, leases: Sequence[Lease], free: Iterable[bool], now: float) -> list[Lease]:
        """Record a look; the leases free on every look for :data:`FREE_FOR` seconds."""
        since = {
            lease: self._since.get(lease, now) for lease, ok in zip(leases, free, strict=True) if ok
        }
        self._since = since
        return [lease for lease, first in since.items() if now - first >= FREE_FOR]

    def forget(self, leases: Iterable[Lease]) -> None:
        """Start over for ``leases`` (looked at, or taken by a run meanwhile)."""
        for lease in leases:
            self._since.pop(lease, None)


class Rescuer:
    """Beat's look at the fetched messages (Redis brokers only), in a thread of its own
    so that a slow database or broker never delays a poll; it looks only while
    :attr:`active` (this beat holds the beat lock). ``runtime``: whose registry and
    weights tell which dead runs fall back (this process's, built at the first rescue)."""

    def __init__(
        self, app: Celery, engine: Engine, runtime: Callable[[], Runtime] = assembly.runtime
    ) -> None:
        self.app, self.engine, self.runtime = app, engine, runtime
        self.active = False
        self.runs = RunLocks(engine)
        self.queue = PhorgeQueue(engine)
        self.free_since = FreeSince()
        self.settled: set[Lease] = set()  # handed back or ended: their messages linger
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @staticmethod
    def wanted(app: Celery) -> bool:
        return str(app.conf.broker_url or "").startswith(("redis", "rediss", "sentinel"))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="rescue", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.runs.close()

    def _loop(self) -> None:
        with self.app.connection_for_read() as conn:
            while not self._stop.wait(LOOK_EVERY):
                if not self.active:
                    continue
                try:
                    self.look(fetched_leases(conn.default_channel), time.monotonic())
                except Exception as exc:
                    log.warning("rescue: no look at the fetched messages: %s", exc)
                    conn.collect()

    def look(self, fetched: Mapping[Lease, Leased], now: float) -> list[int]:
        """One look at the fetched leases (:func:`fetched_leases`): hand back those whose
        lock stayed free long enough, new-side runs of a shared class as fallbacks;
        returns the ids handed back (fallen back included)."""
        self.settled &= fetched.keys()
        unique = [lease for lease in fetched if lease not in self.settled]
        due = self.free_since.due(unique, self.runs.free(unique), now)
        if not due:
            return []
        fall_back = self.fallbacks([fetched[lease] for lease in due])
        result = hand_back_unrun(self.runs, self.queue.session, due, 0, fall_back)
        self.free_since.forget(due)
        self.settled.update(lease for lease in due if lease.task_id not in result.running)
        if result.handed_back:
            log.warning(
                "rescue: %s, from messages a worker fetched and no live run holds",
                result.describe(),
            )
            self.app.send_task(POLL_TASK)
        return result.handed_back

    def fallbacks(self, items: Sequence[Leased]) -> Collection[int]:
        """The ids of ``items`` that fall back (:func:`new_side_runs`); none when this
        process's runtime cannot be built, said each time: a dead worker's tasks must run
        again whatever else is wrong, and a plain hand-back is what they got before
        the canary."""
        try:
            return new_side_runs(self.runtime(), items)
        except Exception as exc:
            log.warning("rescue: handed back without fallbacks (no runtime to tell): %s", exc)
            return ()
