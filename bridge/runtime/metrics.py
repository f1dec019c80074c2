"""Prometheus metrics of the bridge (multiprocess-safe under prefork).

Counters live in each worker child; with ``PROMETHEUS_MULTIPROC_DIR`` set they are
aggregated by the exporter that ``bridge.runtime.lifecycle`` starts when
``BRIDGE_METRICS_PORT`` is configured. Queue depth and age are read from the database
at scrape time, since Flower and broker exporters only see messages.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

DISPATCHED = Counter(
    "phorge_bridge_dispatched_total", "Tasks leased and sent to Celery", ["queue", "task_class"]
)
OUTCOMES = Counter(
    "phorge_bridge_outcomes_total",
    "Task runs by outcome (success, failure, permanent-failure, yield, lease-lost, unreported)",
    ["task_class", "outcome"],
)
DURATION = Histogram("phorge_bridge_task_duration_seconds", "Handler run time", ["task_class"])
RENEWALS = Counter(
    "phorge_bridge_lease_renewals_total", "Lease extensions (claims and heartbeats)", ["result"]
)


class QueueCollector:
    """Gauges of the Phorge queue per class and state, read at each scrape."""

    def __init__(self, queue) -> None:
        self.queue = queue

    def collect(self):
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


def serve(port: int, address: str, queue) -> None:
    """Expose metrics (aggregated over prefork children when multiprocess mode is on)."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    registry.register(QueueCollector(queue))
    start_http_server(port, addr=address, registry=registry)
