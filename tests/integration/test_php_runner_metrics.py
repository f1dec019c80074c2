"""The PHP runner's metrics, from a real pool on the stand-in Phorge: processes, restarts
by cause, resident memory, and its availability's own gauge (never Conduit's)."""

from __future__ import annotations

from php_standin import context, runner_handler, runner_settings
from prometheus_client import REGISTRY

from bridge.handlers.outcome import run_handler
from bridge.queue.model import Outcome
from bridge.transports.conduit import metrics as conduit_metrics
from bridge.transports.php_runner import metrics as runner_metrics


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_processes_restarts_by_cause_and_rss_are_counted() -> None:
    processes = sample("phorge_bridge_php_runner_processes")
    died = sample("phorge_bridge_php_runner_restarts_total", cause="died")
    tasks = sample("phorge_bridge_php_runner_restarts_total", cause="tasks")
    with runner_handler(runner_settings(max_tasks=2)) as handler:
        runner_metrics.watch(handler)
        runner_metrics.watch(handler)  # once per pool
        handler.start(1)
        assert sample("phorge_bridge_php_runner_processes") == processes + 1
        assert run_handler(handler, context("StandinPidWorker")).outcome is Outcome.SUCCESS
        assert sample("phorge_bridge_php_runner_rss_bytes") > 1024 * 1024
        assert run_handler(handler, context("StandinSegfaultWorker")).outcome is Outcome.FAILURE
        assert sample("phorge_bridge_php_runner_restarts_total", cause="died") == died + 1
        for _ in range(2):
            run_handler(handler, context("StandinPidWorker"))
        assert sample("phorge_bridge_php_runner_restarts_total", cause="tasks") == tasks + 1
    assert sample("phorge_bridge_php_runner_processes") == processes


def test_the_runners_availability_has_a_gauge_of_its_own() -> None:
    assert conduit_metrics.CONDUIT_BREAKER_OPEN is not None  # Conduit's gauge is there too
    conduit = sample("phorge_bridge_conduit_breaker_open")
    settings = runner_settings()
    with runner_handler(settings) as handler:
        runner_metrics.watch(handler)
        handler.availability.failure("cannot boot")
        assert sample("phorge_bridge_php_runner_unavailable") == 1
        assert sample("phorge_bridge_conduit_breaker_open") == conduit
        handler.availability.success()
        assert sample("phorge_bridge_php_runner_unavailable") == 0
