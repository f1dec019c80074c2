"""Queues with due rows and no live consumer, judged from the database and Celery.

A worker that died, or lives on without consuming, leaves its queue's rows due forever
while beat keeps polling (issue 11). Neither side sees that alone: the database knows
which rows are due and, through the router, their Celery queue; the live workers'
announcements (``bridge.runtime.announce``, through Celery's remote control) say which
queues they consume and what they serve. The control queue counts as needed whenever any
served row is due, since nothing is leased without its ``bridge.poll``. ``doctor``,
``stats``, the poller (its log, and what it leases for other workers) and the metrics
all use :func:`fleet_survey`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from celery import Celery
from prometheus_client.core import GaugeMetricFamily

from bridge.config import Settings
from bridge.handlers.registry import Coverage, Registry
from bridge.queue.model import DUE_STATES, QueueStats
from bridge.runtime.announce import Announcement, announcements

log = logging.getLogger(__name__)

INSPECT_TIMEOUT = 1.0  # seconds to wait for the workers' answers
CHECK_EVERY = 15.0  # seconds a poller or scrape reuses the last answer


@dataclass(frozen=True)
class QueueConsumers:
    """One Celery queue of the bridge: its due rows and the worker nodes consuming it."""

    queue: str
    due: int
    consumers: tuple[str, ...] | None  # None: the broker has no control API (sqla://)

    @property
    def stranded(self) -> bool:
        """Due rows that nothing will run."""
        return self.due > 0 and self.consumers == ()


def describe(status: QueueConsumers, control_queue: str | None = None) -> str:
    """One line for an operator: the queue, its due rows, who consumes it. The control
    queue carries polls, not Phorge's tasks: its due count is every served queue's, so
    it says what it carries instead."""
    if status.consumers is None:
        who = "unknown workers (this broker has no control API)"
    else:
        who = ", ".join(status.consumers) or "NO LIVE WORKER"
    polls = status.queue == control_queue
    carries = "polls (needed while any task is due)" if polls else f"{status.due} due"
    return f"{status.queue}: {carries}, consumed by {who}"


@dataclass(frozen=True)
class Survey:
    """Each queue of the bridge with its consumers, and each live worker's announcement
    (none when the broker has no control API)."""

    queues: list[QueueConsumers] = field(default_factory=list)
    nodes: dict[str, Announcement] = field(default_factory=dict)


def consumers_by_queue(nodes: dict[str, Announcement] | None) -> dict[str, list[str]] | None:
    """Queue name -> live worker nodes consuming it (None: nobody could answer)."""
    if nodes is None:
        return None
    consumers: dict[str, list[str]] = defaultdict(list)
    for node, announcement in nodes.items():
        for queue in announcement.queues:
            consumers[queue].append(node)
    return consumers


def due_by_queue(stats: QueueStats, served: Iterable[str], settings: Settings) -> dict[str, int]:
    """Due rows of the served classes per Celery queue, the control queue included."""
    due: dict[str, int] = dict.fromkeys([settings.control_queue, *settings.router.queues], 0)
    for task_class in served:
        count = sum(stats.by_class.get(task_class, {}).get(s, 0) for s in DUE_STATES)
        due[settings.router.queue_for(task_class)] += count
        due[settings.control_queue] += count
    return due


def judge(due: dict[str, int], consumers: dict[str, list[str]] | None) -> list[QueueConsumers]:
    """Every queue of ``due`` with its consumers (unknown when ``consumers`` is None)."""
    return [
        QueueConsumers(q, n, None if consumers is None else tuple(sorted(consumers.get(q, ()))))
        for q, n in due.items()
    ]


def serves(
    task_class: str, registry: Registry, settings: Settings, coverages: Iterable[Coverage]
) -> bool:
    """Whether this process, a worker of one of ``coverages``, or (a rule routes it) the
    workers of its queue serve ``task_class``."""
    return (
        registry.handler_for(task_class) is not None
        or settings.router.routed(task_class)
        or any(coverage.transport_for(task_class) for coverage in coverages)
    )


def fleet_survey(
    app: Celery,
    stats: QueueStats,
    registry: Registry,
    settings: Settings,
    known: Iterable[Coverage] = (),
) -> Survey:
    """Each queue of the bridge, its due rows as of ``stats``, its consumers now, and the
    workers' announcements. Due rows count when their class is served by this process,
    a live worker, a worker of the ``known`` coverages (workers seen before, now gone:
    their queue is stranded, not empty), or a routed queue's workers. Raises kombu's
    OperationalError when the broker is unreachable."""
    announced = announcements(app, INSPECT_TIMEOUT)
    nodes = announced or {}
    coverages = [*known, *(a.coverage for a in nodes.values())]
    served = [c for c in stats.by_class if serves(c, registry, settings, coverages)]
    due = due_by_queue(stats, served, settings)
    return Survey(judge(due, consumers_by_queue(announced)), nodes)


def survey(
    app: Celery, stats: QueueStats, registry: Registry, settings: Settings
) -> list[QueueConsumers]:
    """:func:`fleet_survey`'s queues."""
    return fleet_survey(app, stats, registry, settings).queues


class ConsumerWatch:
    """:func:`survey`'s answer, refreshed at most every ``every`` seconds.

    The control API costs up to ``INSPECT_TIMEOUT`` per call, so a poll every second or a
    scrape must not pay it each time. With ``log_changes`` a refresh logs each queue that
    became stranded or was consumed again, once per change (per process). A queue is
    called stranded only when two refreshes in a row found it so: a fleet starting with
    rows due polls before its workers are ready, and they were seconds from consuming.
    """

    def __init__(
        self,
        survey: Callable[[Collection[Coverage]], Survey],
        every: float = CHECK_EVERY,
        *,
        log_changes: bool = False,
    ) -> None:
        self.survey, self.every, self.log_changes = survey, every, log_changes
        self.checked_at: float | None = None
        self.last = Survey()
        # What the workers seen since this process started serve (gone ones too), so a
        # queue whose workers all left still shows its due rows (and can scale from 0).
        self.known: set[Coverage] = set()
        self.reported: set[str] = set()  # queues logged as stranded
        self._lock = threading.Lock()
        self._refreshing = False

    def current(self) -> Survey:
        """The last answer, refreshed first when it is older than ``every``."""
        if self._due():
            self._refresh()
        return self.last

    def refresh_soon(self) -> None:
        """Refresh on a daemon thread when due, so a poll never waits on the control API
        (its answers take ``INSPECT_TIMEOUT`` to gather). A failed refresh is logged."""
        with self._lock:
            if self._refreshing or not self._due():
                return
            self._refreshing = True

        def refresh() -> None:
            try:
                self._refresh()
            except Exception as exc:
                log.warning("could not check the queues' consumers: %s", exc)
            finally:
                self._refreshing = False

        threading.Thread(target=refresh, name="consumer-watch", daemon=True).start()

    def _due(self) -> bool:
        return self.checked_at is None or time.monotonic() - self.checked_at >= self.every

    def runs_elsewhere(self, task_class: str, queue: str, node: str) -> bool:
        """Whether, in the last answer, a live worker other than ``node`` consumes
        ``queue`` and would run ``task_class`` there (it serves it, its transport up)."""
        return any(
            announced.runs(task_class, queue)
            for name, announced in self.last.nodes.items()
            if name != node
        )

    def served(self, task_class: str) -> bool:
        """Whether a worker seen since this process started serves ``task_class``."""
        return any(coverage.transport_for(task_class) for coverage in self.known)

    def _refresh(self) -> None:
        self.checked_at = time.monotonic()
        before = {q.queue for q in self.last.queues if q.stranded}
        self.last = self.survey(frozenset(self.known))
        self.known.update(a.coverage for a in self.last.nodes.values())
        if self.log_changes:
            self._log(before)

    def _log(self, before: set[str]) -> None:
        for status in self.last.queues:
            if status.stranded and status.queue in before - self.reported:
                self.reported.add(status.queue)
                log.error(
                    "queue %s has %d due task(s) and no live worker consuming it",
                    status.queue,
                    status.due,
                )
            elif not status.stranded and status.queue in self.reported:
                self.reported.discard(status.queue)
                # Stranded before: this broker answers the control API, so consumers is known.
                assert status.consumers is not None
                log.warning("queue %s is consumed again (%s)", status.queue, ", ".join(
                    status.consumers) or "no rows due")  # fmt: skip


class ConsumersCollector:
    """Prometheus gauges per queue: live consumers, and 1 when due rows have none."""

    def __init__(self, watch: ConsumerWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterator[GaugeMetricFamily]:
        statuses = self.watch.current().queues
        consumers = GaugeMetricFamily(
            "phorge_bridge_queue_consumers",
            "Live Celery workers consuming the queue (control API)",
            labels=["queue"],
        )
        stranded = GaugeMetricFamily(
            "phorge_bridge_queue_without_consumer",
            "1 when the queue has due rows and no live worker consumes it",
            labels=["queue"],
        )
        for status in statuses:
            if status.consumers is None:
                continue
            consumers.add_metric([status.queue], len(status.consumers))
            stranded.add_metric([status.queue], int(status.stranded))
        yield consumers
        yield stranded
