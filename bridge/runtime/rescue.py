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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from celery import Celery
from kombu.utils.json import loads
from sqlalchemy import Engine

from bridge.engine.redelivery import hand_back_unrun
from bridge.queue import Lease, PhorgeQueue
from bridge.queue.run_locks import RunLocks
from bridge.runtime.dispatch import EXECUTE_BATCH, EXECUTE_TASK

log = logging.getLogger(__name__)

LOOK_EVERY = 2.0  # seconds between two looks at the fetched messages
FREE_FOR = 4.0  # seconds a fetched lease's lock must stay free before it is handed back
POLL_TASK = "bridge.poll"


def leases_of(name: str, args: Sequence[Any]) -> list[Lease]:
    """The leases an execute message carries (``bridge.runtime.dispatch``)."""
    if name == EXECUTE_TASK:
        task_id, owner, failure_count = args[:3]
        return [Lease(int(task_id), str(owner), int(failure_count))]
    if name == EXECUTE_BATCH:
        owner, tasks = args[:2]
        return [Lease(int(task[0]), str(owner), int(task[1])) for task in tasks]
    return []


def fetched_leases(channel: Any) -> list[Lease]:
    """The leases of every execute message some consumer fetched and has not acked, from
    kombu's Redis ``unacked`` hash (each entry: the message, its exchange and routing key)."""
    found: list[Lease] = []
    for raw in channel.client.hvals(channel.unacked_key):
        try:
            payload, _, _ = loads(raw)
            message = channel.Message(payload, channel=channel)
            name = message.headers.get("task", "")
            if name in (EXECUTE_TASK, EXECUTE_BATCH):
                args, _kwargs, _embed = message.decode()
                found.extend(leases_of(name, args))
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
    :attr:`active` (this beat holds the beat lock)."""

    def __init__(self, app: Celery, engine: Engine) -> None:
        self.app, self.engine = app, engine
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

    def look(self, leases: Sequence[Lease], now: float) -> list[int]:
        """One look: hand back the leases whose lock stayed free long enough; returns
        the ids handed back."""
        present = dict.fromkeys(leases)
        self.settled &= present.keys()
        unique = [lease for lease in present if lease not in self.settled]
        due = self.free_since.due(unique, self.runs.free(unique), now)
        if not due:
            return []
        result = hand_back_unrun(self.runs, self.queue.session, due, 0)
        self.free_since.forget(due)
        self.settled.update(lease for lease in due if lease.task_id not in result.running)
        if result.handed_back:
            log.warning(
                "rescue: %s, from messages a worker fetched and no live run holds",
                result.describe(),
            )
            self.app.send_task(POLL_TASK)
        return result.handed_back
