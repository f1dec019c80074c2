"""The PHP runner's gauges: whether it can boot, its processes, their memory and restarts."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from bridge.transports.php_runner.handler import PhpRunnerHandler
from bridge.transports.php_runner.pool import PoolListener, Restart
from bridge.transports.php_runner.process import RunnerProcess

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


def watch(runner: PhpRunnerHandler) -> None:
    """Show ``runner``'s availability and its pool's processes in the gauges (once)."""
    if any(isinstance(listener, RunnerPoolMetrics) for listener in runner.pool.listeners):
        return
    runner.pool.listeners.append(RunnerPoolMetrics())
    availability = runner.availability
    PHP_RUNNER_UNAVAILABLE.set(int(availability.is_down))
    availability.listeners.append(lambda down: PHP_RUNNER_UNAVAILABLE.set(int(down)))
