"""The Phorge queue's depth, age and pace per Celery queue, read at each scrape.

What an autoscaler needs (docs/scaling.md, "Autoscaling"): the served tasks due
and dispatched per queue, the oldest of each, and each queue's pace. Under a
canary these count only the share the bridge takes; phd's share is served per class
apart, so that a share nobody takes is seen too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from bridge.canary.weights import Canary
from bridge.engine.context import CanarySource, FixedCanary
from bridge.engine.pace import MIN_COST, WINDOW, Pace
from bridge.handlers.registry import Registry
from bridge.queue.beat_lock import beat_lock_holder
from bridge.queue.dialect import is_mysql
from bridge.queue.implementations import CELERY
from bridge.queue.model import DUE_STATES, State
from bridge.queue.phorge_queue import PhorgeQueue
from bridge.routing import Router


@dataclass
class QueueFigures:
    """One Celery queue's served tasks: due and not yet dispatched, and dispatched but
    not done (waiting in the broker, or running), each with its oldest's age."""

    due: int = 0
    oldest_due: int = 0
    dispatched: int = 0
    oldest_dispatched: int = 0

    def add(
        self, state: str, count: int, due_since: int | None, leased_at: int | None, now: int
    ) -> None:
        if state in DUE_STATES:
            self.due += count
            self.oldest_due = max(self.oldest_due, now - (due_since or now))
        elif state == State.LEASED.value:
            self.dispatched += count
            self.oldest_dispatched = max(self.oldest_dispatched, now - (leased_at or now))


def figures_by_queue(
    rows: Iterable[Any], now: int, served: Collection[str], router: Router
) -> dict[str, QueueFigures]:
    """``PhorgeQueue.ages`` summed per Celery queue, the served classes only (every queue
    of ``router`` present, at zero when idle)."""
    figures = {queue: QueueFigures() for queue in router.queues}
    for task_class, state, count, due_since, leased_at, _ours in rows:
        if task_class in served:
            queue = figures.setdefault(router.queue_for(task_class), QueueFigures())
            queue.add(state, count, due_since, leased_at, now)
    return figures


def split_shares(rows: Sequence[Any], canary: Canary) -> tuple[list[Any], list[Any]]:
    """``PhorgeQueue.ages`` rows as the bridge's and phd's under ``canary``: a class at
    celery weight 0 is wholly phd's, a shared one by the rows' ``ours``."""
    if not canary.active:
        return list(rows), []
    bridges: list[Any] = []
    phds: list[Any] = []
    for row in rows:
        mine = row.ours and canary.weight(row.taskClass, CELERY) > 0
        (bridges if mine else phds).append(row)
    return bridges, phds


class QueueCollector:
    """Gauges of the Phorge queue per class and state, and per served Celery queue,
    read at each scrape."""

    FIGURES = (
        ("phorge_bridge_queue_due_tasks", "due", "Served tasks due and not yet dispatched"),
        (
            "phorge_bridge_oldest_due_seconds",
            "oldest_due",
            "How long the served task due the longest has waited to be dispatched",
        ),
        (
            "phorge_bridge_queue_dispatched_tasks",
            "dispatched",
            "Served tasks dispatched and not done: waiting in the broker, or running",
        ),
        (
            "phorge_bridge_oldest_dispatched_seconds",
            "oldest_dispatched",
            "Time since the oldest task still dispatched was sent (in the broker, or running)",
        ),
    )

    def __init__(
        self,
        queue: PhorgeQueue,
        registry: Registry,
        router: Router,
        owner_prefix: str = "bridge",
        *,
        fleet: Callable[[str], bool] | None = None,
        canary: CanarySource | None = None,
    ) -> None:
        """A queue's figures count the classes this process serves, those a rule of
        ``router`` routes (their queue's workers serve them, even scaled to zero), and
        those ``fleet`` says another worker serves (a control worker without PHP counts
        the PHP workers' rows); of a class shared with phd under ``canary``'s weights,
        only the bridge's share (phd's is served apart, per class)."""
        self.queue, self.registry, self.router = queue, registry, router
        self.owner_prefix = owner_prefix
        self.fleet = fleet
        self.canary = canary or FixedCanary()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.queue.stats()
        tasks = GaugeMetricFamily(
            "phorge_bridge_queue_tasks",
            "Phorge tasks per class and state (archived-*: of the last hour)",
            labels=["task_class", "state"],
        )
        for task_class, states in stats.by_class.items():
            for state, count in states.items():
                tasks.add_metric([task_class, state], count)
        yield tasks
        canary = self.canary.current()
        shares = {name: w for name, level, w in canary.partial() if level == CELERY}
        rows, phds = split_shares(self.queue.ages(stats.server_time, shares), canary)
        classes = {row[0] for row in rows}
        served = set(self.registry.runnable(classes))
        served.update(c for c in classes if self.router.routed(c))
        if self.fleet is not None:
            served.update(c for c in classes if self.fleet(c))
        figures = figures_by_queue(rows, stats.server_time, served, self.router)
        for name, field, help_text in self.FIGURES:
            family = GaugeMetricFamily(name, help_text, labels=["queue"])
            for queue, figure in figures.items():
                family.add_metric([queue], getattr(figure, field))
            yield family
        yield from self.paces(served, figures)
        if canary.active:
            yield from self.phd_share_gauges(phds, stats.server_time)
        if is_mysql(self.queue.engine):  # SQLite runs one beat, in the worker's host
            beat = GaugeMetricFamily(
                "phorge_bridge_beat_running",
                "1 while a beat holds the beat lock and sends the polls, else 0",
            )
            beat.add_metric(
                [], int(beat_lock_holder(self.queue.engine, self.owner_prefix) is not None)
            )
            yield beat

    def phd_share_gauges(self, rows: Iterable[Any], now: int) -> Iterator[GaugeMetricFamily]:
        """The due rows the weights give phd, per class: what only a
        ``PhorgeBridgeQueueDaemon`` takes (the alert PhorgeBridgePhdShareStalled)."""
        due = GaugeMetricFamily(
            "phorge_bridge_phd_share_due_tasks",
            "Tasks due that the canary's weights give phd (not the bridge's backlog)",
            labels=["task_class"],
        )
        oldest = GaugeMetricFamily(
            "phorge_bridge_phd_share_oldest_due_seconds",
            "How long the task of phd's share due the longest has waited for phd",
            labels=["task_class"],
        )
        by_class: dict[str, QueueFigures] = {}
        for task_class, state, count, due_since, leased_at, _ours in rows:
            figures = by_class.setdefault(task_class, QueueFigures())
            figures.add(state, count, due_since, leased_at, now)
        for task_class, figures in sorted(by_class.items()):
            due.add_metric([task_class], figures.due)
            oldest.add_metric([task_class], figures.oldest_due)
        yield due
        yield oldest

    def paces(self, served: Collection[str], queues: Iterable[str]) -> Iterator[GaugeMetricFamily]:
        """Each queue's pace (``bridge.engine.pace``, from its archived runs of the last
        ``WINDOW`` seconds): what a scaler's "tasks per replica" needs. Slots needed to
        drain a backlog of ``due`` tasks within ``T`` seconds: ``due / (per_slot * T)``."""
        per_slot = GaugeMetricFamily(
            "phorge_bridge_queue_throughput_per_slot",
            "Tasks a second one busy worker slot of the queue completes (1 / mean run "
            f"time, over the last {WINDOW} s; 0 without recent runs)",
            labels=["queue"],
        )
        busy = GaugeMetricFamily(
            "phorge_bridge_queue_busy_slots",
            f"Worker slots the queue kept busy over the last {WINDOW} s (rate x mean run time)",
            labels=["queue"],
        )
        by_queue: dict[str, list[str]] = {queue: [] for queue in queues}
        for task_class in served:
            by_queue.setdefault(self.router.queue_for(task_class), []).append(task_class)
        for queue, classes in by_queue.items():
            pace = Pace.of(self.queue.recent_runs(classes, WINDOW)) if classes else None
            per_slot.add_metric([queue], 1 / max(pace.mean, MIN_COST) if pace else 0.0)
            busy.add_metric([queue], pace.busy if pace else 0.0)
        yield per_slot
        yield busy
