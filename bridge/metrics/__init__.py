"""Prometheus metrics of the bridge, summed over a worker's prefork children.

Counters live in each worker child. A worker that serves metrics (``BRIDGE_METRICS_PORT``)
counts in mmap files from before its pool forks (:func:`count_across_processes`), and
its exporter, started by ``bridge.runtime.lifecycle``, sums them. Queue depth and age
are read from the database at scrape time, since Flower and broker exporters only see
messages.
"""

from __future__ import annotations

import errno
import glob
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    start_http_server,
    values,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select

from bridge._version import __version__
from bridge.engine.pace import MIN_COST, WINDOW, Pace
from bridge.handlers.breaker import CircuitBreaker
from bridge.handlers.php_runner import BREAKER_NAME as RUNNER_BREAKER
from bridge.phorge.runner_pool import PoolListener, Restart, RunnerPool
from bridge.phorge.runner_process import RunnerProcess
from bridge.queue.beat_lock import beat_lock_holder
from bridge.queue.dialect import is_mysql, owner_epoch
from bridge.queue.model import DUE_STATES, YIELD_OWNER, State
from bridge.queue.schema import worker_activetask as active
from bridge.queue.statements import state_case
from bridge.scratch import private_directory

if TYPE_CHECKING:
    from bridge.handlers.registry import Registry
    from bridge.queue.phorge_queue import PhorgeQueue
    from bridge.routing import Router

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"

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
    "Task runs by outcome (success, failure, permanent-failure, yield, lease-lost, unreported)",
    ["task_class", "outcome"],
)
UNWRITTEN = Counter(
    "phorge_bridge_outcome_write_failures_total",
    "Outcomes the database did not take (counted unreported; the lease will expire)",
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
CONDUIT_BREAKER_OPEN = Gauge(
    "phorge_bridge_conduit_breaker_open",
    "1 while Conduit's circuit breaker holds PHP-only tasks back (max over processes)",
    multiprocess_mode="livemax",
)
PHP_RUNNER_UNAVAILABLE = Gauge(
    "phorge_bridge_php_runner_unavailable",
    "1 while the PHP runner cannot boot and its classes are held back (max over processes)",
    multiprocess_mode="livemax",
)
PHP_RUNNER_PROCESSES = Gauge(
    "phorge_bridge_php_runner_processes",
    "PHP runner processes started and not yet ended, over the worker's processes",
    multiprocess_mode="livesum",
)
PHP_RUNNER_RSS = Gauge(
    "phorge_bridge_php_runner_rss_bytes",
    "Resident memory of the PHP runner processes, as last read after a task",
    multiprocess_mode="livesum",
)
PHP_RUNNER_RESTARTS = Counter(
    "phorge_bridge_php_runner_restarts_total",
    "PHP runner processes replaced, by cause (tasks, age, rss, reload, died, deadline)",
    ["cause"],
)
WRITES_REFUSED = Gauge(
    "phorge_bridge_database_writes_refused",
    "1 while the database refuses this worker's writes (read-only, full): no task starts",
    multiprocess_mode="livemax",
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


def watch_breaker(breaker: CircuitBreaker) -> None:
    """Show ``breaker``'s state in its gauge: :data:`CONDUIT_BREAKER_OPEN`, or the PHP
    runner's :data:`PHP_RUNNER_UNAVAILABLE`."""
    gauge = PHP_RUNNER_UNAVAILABLE if breaker.name == RUNNER_BREAKER else CONDUIT_BREAKER_OPEN
    gauge.set(int(breaker.is_open))
    breaker.listeners.append(lambda is_open: gauge.set(int(is_open)))


class RunnerPoolMetrics(PoolListener):
    """The PHP runner pool's processes, restarts by cause and memory, in the gauges."""

    def __init__(self) -> None:
        self._rss: dict[int, int] = {}

    def started(self, process: RunnerProcess) -> None:
        PHP_RUNNER_PROCESSES.inc()

    def ended(self, process: RunnerProcess, cause: Restart | None) -> None:
        PHP_RUNNER_PROCESSES.dec()
        if cause is not None:
            PHP_RUNNER_RESTARTS.labels(cause=cause.value).inc()
        self._rss.pop(process.pid, None)
        PHP_RUNNER_RSS.set(sum(self._rss.values()))

    def returned(self, process: RunnerProcess, rss: int) -> None:
        self._rss[process.pid] = rss
        PHP_RUNNER_RSS.set(sum(self._rss.values()))


def watch_runner_pool(pool: RunnerPool) -> None:
    """Count ``pool``'s processes in the PHP runner metrics (once per pool)."""
    if not any(isinstance(listener, RunnerPoolMetrics) for listener in pool.listeners):
        pool.listeners.append(RunnerPoolMetrics())


# -- prefork: every process counts in files of one directory -------------------------------


def count_across_processes() -> str:
    """Count in mmap files of one directory from now on, this process and those it
    forks, so that the exporter sums the prefork children; returns the directory.

    ``PROMETHEUS_MULTIPROC_DIR`` names it, else it is a private one removed at exit.
    prometheus_client picks its mode when first imported, before Celery says this
    process is a worker, so the switch happens here, before the pool forks: the
    values made until now are made again, in files.
    """
    directory = os.environ.get(MULTIPROC_DIR) or private_directory("phorge-bridge-metrics-")
    os.makedirs(directory, exist_ok=True)
    if not getattr(values.ValueClass, "_multiprocess", False):
        _make_values_again(directory)
    return directory


def _make_values_again(directory: str) -> None:
    """Labelled metrics drop their children (made again on use) while the process is
    still in single-process mode: once ``directory`` is named, ``clear()`` warns that it
    leaves their files, which these children never had. Then the others remake their
    value as their constructor does (``_metric_init``: prometheus_client has no public
    way), so every value counts in a file."""
    metrics = [metric for metric in globals().values() if isinstance(metric, MetricWrapperBase)]
    for metric in metrics:
        metric.clear()  # a metric without labels has no children: nothing to do
    os.environ[MULTIPROC_DIR] = directory
    values.ValueClass = values.MultiProcessValue()
    for metric in metrics:
        if not metric._labelnames:
            metric._metric_init()
    outcome_counter.cache_clear()
    run_timers.cache_clear()


class ProcessesCollector:
    """The sums over every process that counted in ``directory``, dead ones included,
    except the live gauges (the breaker, refused writes) of processes gone."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Metric]:
        for pid in self._dead_pids():
            mark_process_dead(pid, self.directory)
        yield from MultiProcessCollector(None, self.directory).collect()

    def _dead_pids(self) -> set[int]:
        pids = set()
        for path in glob.glob(os.path.join(self.directory, "gauge_live*_*.db")):
            pid = int(path.rsplit("_", 1)[1].removesuffix(".db"))
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                pids.add(pid)
            except PermissionError:  # alive, another user's
                pass
        return pids


# -- read from the database at each scrape ------------------------------------------------


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


def age_rows(queue: PhorgeQueue, now: int) -> list[Any]:
    """Active rows per (class, state): count, since when the first was due (its lease
    expiry, else its creation), when the first was leased (its owner's epoch)."""
    c = active.c
    state = state_case(now).label("state")
    query = select(
        c.taskClass,
        state,
        func.count(),
        func.min(func.coalesce(c.leaseExpires, c.dateCreated)),
        func.min(case((c.leaseOwner != YIELD_OWNER, owner_epoch(c.leaseOwner)))),
    ).group_by(c.taskClass, state)
    with queue.engine.connect() as conn:
        return list(conn.execute(query))


def figures_by_queue(
    rows: Iterable[Any], now: int, served: Collection[str], router: Router
) -> dict[str, QueueFigures]:
    """:func:`age_rows` summed per Celery queue, the served classes only (every queue
    of ``router`` present, at zero when idle)."""
    figures = {queue: QueueFigures() for queue in router.queues}
    for task_class, state, count, due_since, leased_at in rows:
        if task_class in served:
            queue = figures.setdefault(router.queue_for(task_class), QueueFigures())
            queue.add(state, count, due_since, leased_at, now)
    return figures


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
    ) -> None:
        """A queue's figures count the classes this process serves, those a rule of
        ``router`` routes (their queue's workers serve them, even scaled to zero), and
        those ``fleet`` says another worker serves (a control worker without PHP counts
        the PHP workers' rows)."""
        self.queue, self.registry, self.router = queue, registry, router
        self.owner_prefix = owner_prefix
        self.fleet = fleet

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
        rows = age_rows(self.queue, stats.server_time)
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
        if is_mysql(self.queue.engine):  # SQLite runs one beat, in the worker's host
            beat = GaugeMetricFamily(
                "phorge_bridge_beat_running",
                "1 while a beat holds the beat lock and sends the polls, else 0",
            )
            beat.add_metric(
                [], int(beat_lock_holder(self.queue.engine, self.owner_prefix) is not None)
            )
            yield beat

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


# -- the exporter ------------------------------------------------------------------------


def serve(ports: range, address: str, *collectors: Collector) -> int | None:
    """Expose the bridge's version and ``collectors``' metrics (read in this process at
    each scrape) on the first free port of ``ports``; returns it, or None when every
    one is taken."""
    registry = CollectorRegistry()
    Info("phorge_bridge_build", "The bridge's version", registry=registry).info(
        {"version": __version__}
    )
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
