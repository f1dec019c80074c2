"""Queues with due rows and no live consumer, judged from the database and Celery.

A worker that died, or lives on without consuming, leaves its queue's rows due forever
while beat keeps polling (issue 11). Neither side sees that alone: the database knows
which rows are due and, through the router, their Celery queue; Celery's control API
(``inspect().active_queues()``) knows which queues live workers consume. The control
queue counts as needed whenever any served row is due, since nothing is leased without
its ``bridge.poll``. ``doctor``, ``stats``, the poller's log and the metrics all use
:func:`survey`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from celery import Celery
from prometheus_client.core import GaugeMetricFamily

from bridge.config import Settings
from bridge.handlers.registry import Registry
from bridge.queue.model import DUE_STATES, QueueStats

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


def describe(status: QueueConsumers) -> str:
    """One line for an operator: the queue, its due rows, who consumes it."""
    if status.consumers is None:
        who = "unknown workers (this broker has no control API)"
    else:
        who = ", ".join(status.consumers) or "NO LIVE WORKER"
    return f"{status.queue}: {status.due} due, consumed by {who}"


def consumers_by_queue(
    app: Celery, timeout: float = INSPECT_TIMEOUT
) -> dict[str, list[str]] | None:
    """Queue name -> live worker nodes consuming it, from the workers' own answers; None
    when the transport cannot broadcast (kombu's SQLAlchemy one), so nobody would answer.
    Raises kombu's OperationalError when the broker is unreachable."""
    with app.connection_for_read() as connection:
        if "fanout" not in connection.transport.implements.exchange_type:
            return None
    replies = app.control.inspect(timeout=timeout).active_queues() or {}
    nodes: dict[str, list[str]] = defaultdict(list)
    for node, queues in replies.items():
        for queue in queues or ():
            nodes[queue["name"]].append(node)
    return nodes


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


def survey(
    app: Celery, stats: QueueStats, registry: Registry, settings: Settings
) -> list[QueueConsumers]:
    """Each queue of the bridge, its due rows as of ``stats``, and its consumers now."""
    due = due_by_queue(stats, registry.runnable(list(stats.by_class)), settings)
    return judge(due, consumers_by_queue(app))


class ConsumerWatch:
    """:func:`survey`'s answer, refreshed at most every ``every`` seconds.

    The control API costs up to ``INSPECT_TIMEOUT`` per call, so a poll every second or a
    scrape must not pay it each time. With ``log_changes`` a refresh logs each queue that
    became stranded or was consumed again, once per change (per process).
    """

    def __init__(
        self,
        survey: Callable[[], list[QueueConsumers]],
        every: float = CHECK_EVERY,
        *,
        log_changes: bool = False,
    ) -> None:
        self.survey, self.every, self.log_changes = survey, every, log_changes
        self.checked_at: float | None = None
        self.last: list[QueueConsumers] = []
        self._lock = threading.Lock()
        self._refreshing = False

    def current(self) -> list[QueueConsumers]:
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

    def _refresh(self) -> None:
        self.checked_at = time.monotonic()
        before = {q.queue for q in self.last if q.stranded}
        self.last = self.survey()
        if self.log_changes:
            self._log(before)

    def _log(self, before: set[str]) -> None:
        for status in self.last:
            if status.stranded and status.queue not in before:
                log.error(
                    "queue %s has %d due task(s) and no live worker consuming it",
                    status.queue,
                    status.due,
                )
            elif not status.stranded and status.queue in before:
                # Stranded before: this broker answers the control API, so consumers is known.
                assert status.consumers is not None
                log.warning("queue %s is consumed again (%s)", status.queue, ", ".join(
                    status.consumers) or "no rows due")  # fmt: skip


class ConsumersCollector:
    """Prometheus gauges per queue: live consumers, and 1 when due rows have none."""

    def __init__(self, watch: ConsumerWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterator[GaugeMetricFamily]:
        statuses = self.watch.current()
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
