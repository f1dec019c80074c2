"""Prometheus metrics of the bridge (multiprocess-safe under prefork).

Counters live in each worker child; with ``PROMETHEUS_MULTIPROC_DIR`` set they are
aggregated by the exporter that ``bridge.runtime.lifecycle`` starts when
``BRIDGE_METRICS_PORT`` is configured. Queue depth and age are read from the database
at scrape time, since Flower and broker exporters only see messages.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from functools import cache
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from bridge.handlers.breaker import CircuitBreaker

if TYPE_CHECKING:
    from bridge.queue.phorge_queue import PhorgeQueue

DISPATCHED = Counter(
    "phorge_bridge_dispatched_total", "Tasks leased and sent to Celery", ["queue", "task_class"]
)
OUTCOMES = Counter(
    "phorge_bridge_outcomes_total",
    "Task runs by outcome (success, failure, permanent-failure, yield, lease-lost, unreported)",
    ["task_class", "outcome"],
)
DURATION = Histogram(
    "phorge_bridge_task_duration_seconds",
    "Run time of the work, as archived (PHP's own for proxied tasks)",
    ["task_class"],
)
WALL_TIME = Histogram(
    "phorge_bridge_run_wall_seconds",
    "Wall time of a run in the bridge (for proxied tasks: the Conduit round trip)",
    ["task_class"],
)
RENEWALS = Counter(
    "phorge_bridge_lease_renewals_total", "Lease extensions (claims and heartbeats)", ["result"]
)


@cache
def outcome_counter(task_class: str, outcome: str) -> Counter:
    """:data:`OUTCOMES`' child for one class and outcome, looked up once: a run counts
    its outcome on every task, and ``labels()`` costs more than the increment."""
    return OUTCOMES.labels(task_class=task_class, outcome=outcome)


@cache
def run_timers(task_class: str) -> tuple[Histogram, Histogram]:
    """:data:`WALL_TIME`' and :data:`DURATION`'s children for one class, looked up once."""
    return WALL_TIME.labels(task_class=task_class), DURATION.labels(task_class=task_class)


CONDUIT_BREAKER_OPEN = Gauge(
    "phorge_bridge_conduit_breaker_open",
    "1 while Conduit's circuit breaker holds PHP-only tasks back (max over processes)",
    multiprocess_mode="livemax",
)


WRITES_REFUSED = Gauge(
    "phorge_bridge_database_writes_refused",
    "1 while the database refuses this worker's writes (read-only, full): no task starts",
    multiprocess_mode="livemax",
)


def watch_breaker(breaker: CircuitBreaker) -> None:
    """Show ``breaker``'s state in :data:`CONDUIT_BREAKER_OPEN`."""
    CONDUIT_BREAKER_OPEN.set(int(breaker.is_open))
    breaker.listeners.append(lambda is_open: CONDUIT_BREAKER_OPEN.set(int(is_open)))


class QueueCollector:
    """Gauges of the Phorge queue per class and state, read at each scrape."""

    def __init__(self, queue: PhorgeQueue) -> None:
        self.queue = queue

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.queue.stats()
        tasks = GaugeMetricFamily(
            "phorge_bridge_queue_tasks",
            "Phorge tasks per class and state",
            labels=["task_class", "state"],
        )
        for task_class, states in stats.by_class.items():
            for state, count in states.items():
                tasks.add_metric([task_class, state], count)
        yield tasks
        age = GaugeMetricFamily(
            "phorge_bridge_oldest_queued_seconds", "Age of the oldest queued task"
        )
        age.add_metric([], stats.oldest_queued_age or 0)
        yield age


def serve(ports: range, address: str, queue: PhorgeQueue, *collectors: Collector) -> int | None:
    """Expose metrics (aggregated over prefork children when multiprocess mode is on),
    the queue's gauges and ``collectors``' (read in this process at each scrape), on the
    first free port of ``ports``; returns it, or None when every one is taken."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    registry.register(QueueCollector(queue))
    for collector in collectors:
        registry.register(collector)
    for port in ports:
        try:
            start_http_server(port, addr=address, registry=registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        return port
    return None
