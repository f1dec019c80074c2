"""An idle deployment's log at INFO, as compose runs it (``celery -A bridge beat -l
info``; a worker of the control and default queues, ``-c 2``, serving metrics, with a
liveness file): beat and the worker log their start-up, then at most 10 lines a minute
together, and no warning of prometheus_client's. The work fills a log, not the polls.

Beat sends a poll every 0.25 s (the default interval): a line about each was 14,400 an
hour. The window is counted in polls the worker ran, and the bound scaled to its length.
"""

from __future__ import annotations

import re
import time

import requests
from prometheus_client.parser import text_string_to_metric_families

POLL_INTERVAL = 0.25  # the default, as compose runs it
WINDOW_POLLS = 120  # 30 s of polls
LINES_A_MINUTE = 10
METRICS_PORTS = "19600-19699"  # the worker serves on the first free one, and logs it


def polls_run(metrics_url: str) -> float:
    """The polls the worker ran, from its metrics."""
    families = text_string_to_metric_families(requests.get(metrics_url, timeout=5).text)
    samples = {sample.name: sample.value for family in families for sample in family.samples}
    return samples["phorge_bridge_poll_duration_seconds_count"]


def test_an_idle_beat_and_worker_log_next_to_nothing(make_bridge, database_url, amqp_url):
    bridge = make_bridge(
        database_url, amqp_url, POLL_INTERVAL=str(POLL_INTERVAL), METRICS_PORT=METRICS_PORTS
    )
    liveness = bridge.directory / "alive"
    worker = bridge.worker(
        "worker",
        [bridge.control_queue, bridge.default_queue],
        concurrency=2,
        extra=("--liveness-file", str(liveness)),
    )
    beat = bridge.beat(schedule_file=False)
    bridge.wait_ready(worker)
    bridge.wait_until(lambda: "this beat sends the polls" in beat.log(), 30, "beat to lead")
    address = bridge.wait_until(
        lambda: re.search(r"metrics on ([\d.]+:\d+)", worker.log()), 30, "the metrics port"
    ).group(1)
    metrics_url = f"http://{address}/metrics"
    bridge.wait_until(lambda: polls_run(metrics_url) > 0, 30, "the first poll")

    before = {process.name: len(process.log().splitlines()) for process in (worker, beat)}
    started, first = time.monotonic(), polls_run(metrics_url)
    bridge.wait_until(
        lambda: polls_run(metrics_url) >= first + WINDOW_POLLS, 60, f"{WINDOW_POLLS} polls"
    )
    minutes = (time.monotonic() - started) / 60
    logged = [
        line
        for process in (worker, beat)
        for line in process.log().splitlines()[before[process.name] :]
    ]

    assert len(logged) <= LINES_A_MINUTE * minutes, "\n".join(logged)
    assert "UserWarning" not in worker.log() + beat.log()
