"""A worker frozen while connected (SIGSTOP): every signal says so, then its replacement
finishes the work.

The frozen worker keeps its broker connection and consumes nothing, the failure issue 11
asks to catch. Its liveness file goes stale (``phorge-bridge health`` fails, so a
supervisor replaces it); ``doctor`` fails naming its queue, ``stats`` shows the queue
with due rows and no live worker, the metrics gauge is 1, and the poller logs it once.
The supervisor's part is played here: the frozen worker is killed, a new one started,
and the run ends with the fault suite's checks. A worker whose task consumer was cancelled
(alive, connected, its event loop turning) fails its health check too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import requests
from bridge_harness import CLI_INTERVAL
from local_ports import free_port
from prometheus_client.parser import text_string_to_metric_families

MAX_AGE = 12  # seconds of silence before health fails: more than two heartbeats


def without_consumer(url: str) -> dict[str, float]:
    """``phorge_bridge_queue_without_consumer`` per queue, as Prometheus scrapes it."""
    text = requests.get(url, timeout=30).text
    return {
        sample.labels["queue"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "phorge_bridge_queue_without_consumer"
    }


def test_a_frozen_worker_is_reported_everywhere_and_replaced(
    fault_redis, fault_database, make_fault_bridge, fault_run, tmp_path: Path
) -> None:
    port = free_port()
    bridge = make_fault_bridge(fault_database, fault_redis.url, METRICS_PORT=str(port))
    queue = bridge.default_queue
    alive = tmp_path / "worker.alive"
    poller = bridge.worker("poller", [bridge.control_queue])
    bridge.wait_ready(poller)  # first, so that the metrics port is the poller's
    worker = bridge.worker("worker", [queue], extra=("--liveness-file", str(alive)))
    bridge.wait_ready(worker)
    run = fault_run(bridge)
    run.queue(300, duration=0.05)
    run.start()
    bridge.beat()
    run.wait_fraction(0.25)

    def health() -> subprocess.CompletedProcess:
        return bridge.cli("health", "--liveness-file", str(alive), "--max-age", str(MAX_AGE))

    assert health().returncode == 0, "a consuming worker must be healthy"
    os.kill(worker.pid, signal.SIGSTOP)  # connected, consuming nothing
    try:
        bridge.wait_until(
            lambda: health().returncode == 1, 60, "health to fail", interval=CLI_INTERVAL
        )
        assert "not consuming" in health().stderr

        def doctor_fails() -> dict | None:
            checks = json.loads(bridge.cli("doctor", "--json").stdout)["checks"]
            [check] = [c for c in checks if c["name"] == "queue consumers"]
            return check if check["status"] == "fail" else None

        check = bridge.wait_until(
            doctor_fails, 60, "doctor to report the queue", interval=CLI_INTERVAL
        )
        assert f"{queue}: " in check["detail"] and "NO LIVE WORKER" in check["detail"]
        stats = json.loads(bridge.cli("stats", "--json").stdout)
        [status] = [q for q in stats["queues"] if q["queue"] == queue]
        assert status["due"] > 0 and status["consumers"] == []
        url = f"http://127.0.0.1:{port}/metrics"
        bridge.wait_until(lambda: without_consumer(url).get(queue) == 1, 60, "the gauge")
        bridge.wait_until(
            lambda: f"queue {queue} has" in poller.log(), 60, "the poller to log the queue"
        )
    finally:
        worker.kill()  # the supervisor's part; SIGKILL ends a stopped process too
    bridge.processes.remove(worker)  # replaced, not lost: the final checks skip it

    replacement = bridge.worker("replacement", [queue], extra=("--liveness-file", str(alive)))
    bridge.wait_ready(replacement)
    run.over()
    run.check()
    bridge.wait_until(
        lambda: health().returncode == 0, 60, "the replacement to be healthy", interval=CLI_INTERVAL
    )
    bridge.wait_until(lambda: "is consumed again" in poller.log(), 60, "the poller's all-clear")
    assert poller.log().count(f"queue {queue} has") == 1, "logged once per change"
    bridge.wait_until(lambda: without_consumer(url).get(queue) == 0, 60, "the gauge to clear")


def test_a_worker_whose_task_consumer_is_gone_fails_its_health_check(
    fault_redis, fault_database, make_fault_bridge, tmp_path: Path
) -> None:
    """Up, connected, its event loop turning, and no task queue consumed: still unhealthy."""
    bridge = make_fault_bridge(fault_database, fault_redis.url)
    alive = tmp_path / "worker.alive"
    worker = bridge.worker("worker", [bridge.default_queue], extra=("--liveness-file", str(alive)))
    bridge.wait_ready(worker)
    health = ("health", "--liveness-file", str(alive), "--max-age", str(MAX_AGE))
    bridge.wait_until(
        lambda: bridge.cli(*health).returncode == 0, 60, "a healthy worker", interval=CLI_INTERVAL
    )
    control = [sys.executable, "-m", "celery", "-A", "bridge", "control", "cancel_consumer",
               bridge.default_queue, "-d", bridge.node("worker")]  # fmt: skip
    subprocess.run(control, env=bridge.environ("cli"), check=True, capture_output=True)
    bridge.wait_until(
        lambda: bridge.cli(*health).returncode == 1, 60, "health to fail", interval=CLI_INTERVAL
    )
    assert worker.running()
