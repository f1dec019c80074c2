"""The exporter: every process of a worker counts in files, and one serves their sums.

Counters live in each worker child. A worker that serves metrics (``BRIDGE_METRICS_PORT``)
counts in mmap files from before its pool forks (:func:`count_across_processes`), and
its exporter, started by ``bridge.runtime.lifecycle``, sums them (:func:`serve`).
"""

from __future__ import annotations

import errno
import glob
import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Info, start_http_server, values
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

import bridge.metrics
from bridge._version import __version__
from bridge.scratch import private_directory
from bridge.transports.conduit import metrics as conduit_metrics
from bridge.transports.php_runner import metrics as runner_metrics

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
HEADER = 8  # bytes a file has once sized: its used length, then padding


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
    metrics = [
        metric
        for module in (bridge.metrics, runner_metrics, conduit_metrics)
        for metric in vars(module).values()
        if isinstance(metric, MetricWrapperBase)
    ]
    for metric in metrics:
        metric.clear()  # a metric without labels has no children: nothing to do
    os.environ[MULTIPROC_DIR] = directory
    values.ValueClass = values.MultiProcessValue()
    for metric in metrics:
        if not metric._labelnames:
            metric._metric_init()
    bridge.metrics.forget_children()


class ProcessesCollector:
    """The sums over every process that counted in ``directory``, dead ones included,
    except the live gauges (the breaker, refused writes) of processes gone."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Metric]:
        for pid in self._dead_pids():
            mark_process_dead(pid, self.directory)
        yield from MultiProcessCollector.merge(self._started_files(), accumulate=True)

    def _started_files(self) -> list[str]:
        """The processes' files, but those still being made: prometheus_client creates a
        file before it sizes it, and reading one at 0 bytes fails the whole scrape
        (client_python#1199; a CI run here scraped its 500 while a child began counting)."""
        started = []
        for path in glob.glob(os.path.join(self.directory, "*.db")):
            try:
                if os.path.getsize(path) >= HEADER:
                    started.append(path)
            except FileNotFoundError:
                pass  # a live gauge of a process gone, removed meanwhile
        return started

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
