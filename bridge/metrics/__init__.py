"""Prometheus metrics of the bridge, summed over a worker's prefork children.

The engine imports no metrics library: :class:`RunMetrics` hears its events
(``bridge.engine.observers``) and counts them here; the Celery runtime counts its
dispatches and polls directly. Each transport declares its own gauges beside its code
(``bridge.transports.*.metrics``). ``bridge.metrics.exporter`` counts every process's
values in files and serves their sums; ``bridge.metrics.queue`` reads the queue's depth
and age from the database at scrape time, since Flower and broker exporters only see
messages.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

from prometheus_client import Counter, Gauge, Histogram

from bridge.canary.weights import FALLBACK
from bridge.engine.observers import RunObserver, observe
from bridge.engine.reports import RunReport
from bridge.handlers.outcome import HandlerResult
from bridge.queue.model import Leased

DISPATCHED = Counter(
    "phorge_bridge_dispatched_total", "Tasks leased and sent to Celery", ["queue", "task_class"]
)
SENT_ON = Counter(
    "phorge_bridge_sent_on_total",
    "Tasks a batch had no time for, sent on in new messages (not in dispatched_total)",
    ["queue", "task_class"],
)
TASKS_PER_MESSAGE = Histogram(
    "phorge_bridge_tasks_per_message",
    "Tasks a Celery message carries (1: bridge.execute, more: bridge.execute_batch)",
    ["queue"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
OUTCOMES = Counter(
    "phorge_bridge_outcomes_total",
    "Task runs by outcome (success, failure, permanent-failure, yield, fallback, handed-back, "
    "lease-lost, not-served, unreported) and implementation (native, runner, conduit; none "
    "when no handler was chosen)",
    ["task_class", "outcome", "implementation"],
)
UNWRITTEN = Counter(
    "phorge_bridge_outcome_write_failures_total",
    "Outcomes the database did not take (counted unreported; the lease will expire)",
    ["task_class", "outcome"],
)
DURATION = Histogram(
    "phorge_bridge_task_duration_seconds",
    "Run time of the work, as archived (PHP's own for proxied tasks), by implementation "
    "(native, runner, conduit)",
    ["task_class", "implementation"],
)
WALL_TIME = Histogram(
    "phorge_bridge_run_wall_seconds",
    "Wall time of a run in the bridge (for proxied tasks: the Conduit round trip)",
    ["task_class"],
)
RENEWALS = Counter(
    "phorge_bridge_lease_renewals_total", "Lease extensions (claims and heartbeats)", ["result"]
)
POLL_DURATION = Histogram(
    "phorge_bridge_poll_duration_seconds", "Time a bridge.poll took (its count: the polls run)"
)
POLL_ERRORS = Counter(
    "phorge_bridge_poll_errors_total", "Polls that failed, by exception class", ["error"]
)
LAST_POLL = Gauge(
    "phorge_bridge_last_poll_timestamp_seconds",
    "Unix time the last poll that did not fail ended (beat sends one each poll interval)",
    multiprocess_mode="max",
)
GUARD_JUDGED = Gauge(
    "phorge_bridge_canary_guard_last_run_timestamp_seconds",
    "Unix time the canary guard last judged every shared class (beat sends it each "
    "BRIDGE_CANARY_GUARD_INTERVAL); stale while it fails or its worker is gone",
    multiprocess_mode="max",
)
WRITES_REFUSED = Gauge(
    "phorge_bridge_database_writes_refused",
    "1 while the database refuses this worker's writes (read-only, full): no task starts",
    multiprocess_mode="livemax",
)


NO_IMPLEMENTATION = "none"  # the implementation label of a run no handler was chosen for


@cache
def outcome_counter(task_class: str, outcome: str, implementation: str) -> Counter:
    """:data:`OUTCOMES`' child for one class, outcome and implementation, looked up once:
    a run counts its outcome on every task, and ``labels()`` costs more than the
    increment."""
    return OUTCOMES.labels(task_class=task_class, outcome=outcome, implementation=implementation)


@cache
def run_timers(task_class: str, implementation: str) -> tuple[Histogram, Histogram]:
    """:data:`WALL_TIME`' and :data:`DURATION`'s children for one class (and, for the
    duration, implementation), looked up once."""
    duration = DURATION.labels(task_class=task_class, implementation=implementation)
    return WALL_TIME.labels(task_class=task_class), duration


@cache
def implementation_label(ran_by: str | None) -> str:
    """The ``implementation`` label of a run: ``native``, ``runner`` or ``conduit`` (a
    fallback row's old-side run counts as its implementation's)."""
    return NO_IMPLEMENTATION if ran_by is None else ran_by.removesuffix(FALLBACK)


def forget_children() -> None:
    """Drop the children looked up so far (their metrics were made again)."""
    outcome_counter.cache_clear()
    run_timers.cache_clear()


class RunMetrics(RunObserver):
    """The engine's events in the metrics above."""

    def handler_returned(
        self, task_class: str, wall_seconds: float, result: HandlerResult, implementation: str
    ) -> None:
        wall_time, duration = run_timers(task_class, implementation)
        wall_time.observe(wall_seconds)
        duration.observe(result.duration_us / 1e6)

    def run_ended(self, item: Leased, report: RunReport) -> None:
        implementation = implementation_label(report.implementation)
        outcome_counter(item.task_class or "unknown", report.outcome.value, implementation).inc()

    def outcome_unwritten(self, item: Leased, result: HandlerResult) -> None:
        UNWRITTEN.labels(item.task_class or "unknown", result.outcome.value).inc()

    def lease_renewed(self, result: str) -> None:
        RENEWALS.labels(result=result).inc()

    def writes_refused(self, refused: bool) -> None:
        WRITES_REFUSED.set(int(refused))


_counting: list[RunMetrics] = []


def count_runs() -> None:
    """Count this process's runs in the metrics (once; forked children inherit it)."""
    if not _counting:
        _counting.append(RunMetrics())
        observe(_counting[0])


@contextmanager
def observed_poll() -> Iterator[None]:
    """Time a poll, count it as failed if it raises, else note when it ended."""
    started = time.perf_counter()
    try:
        yield
    except Exception as exc:
        POLL_ERRORS.labels(error=type(exc).__name__).inc()
        raise
    else:
        LAST_POLL.set_to_current_time()
    finally:
        POLL_DURATION.observe(time.perf_counter() - started)
