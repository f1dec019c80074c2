"""A poll is not tied to what the worker running it can run (issue 29).

In a scaled fleet the control worker is small and has no PHP; the PHP workers scale.
Each worker announces what it serves (``bridge_serves``), and the poller, on the control
worker, leases PHP-only classes while a live worker consuming their queue runs them.
Once the last PHP worker is gone, their leasing stops within a consumer survey (15 s)
and the dispatch lease; the rows stay due in Phorge's table, and the queue gauges of the
control worker still count them (the queue can scale from zero).
"""

from __future__ import annotations

import signal
import time

import requests
from local_ports import free_port
from php_standin import STANDIN_ROOT, php_binary
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from bridge.queue.model import RESULT_SUCCESS
from bridge.queue.schema import worker_activetask as active

WAIT = 120.0
DISPATCH_LEASE = 5  # leases sent to a worker that went away come back this soon
SURVEY = 16  # the poller asks the workers what they serve every 15 s (1 s to answer)
LIVENESS_TIMEOUT = 30  # `phorge-bridge health --max-age` as docs/scaling.md sets it


def due_gauge(port: int, queue: str) -> float | None:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "phorge_bridge_queue_due_tasks" and sample.labels["queue"] == queue:
                return sample.value
    return None


def live_leases(bridge, ids: list[int]) -> int:
    with bridge.engine.connect() as conn:
        query = select(func.count()).where(
            active.c.id.in_(ids),
            active.c.leaseOwner.is_not(None),
            active.c.leaseExpires > func.unix_timestamp(),
        )
        return conn.execute(query).scalar_one()


def test_a_control_worker_without_php_leases_for_the_php_workers(
    make_bridge, database_url, amqp_url
) -> None:
    php_binary()
    port = free_port()
    bridge = make_bridge(
        database_url,
        amqp_url,
        RUNNER_CLASSES="Standin*",
        DISPATCH_LEASE=str(DISPATCH_LEASE),
    )
    queue = bridge.default_queue
    # No BRIDGE_PHORGE_ROOT: it serves the polls, and the metrics a scaler reads.
    control = bridge.worker(
        "control", [bridge.control_queue], env={"BRIDGE_METRICS_PORT": str(port)}
    )
    php = bridge.worker(
        "php", [queue], concurrency=2, env={"BRIDGE_PHORGE_ROOT": str(STANDIN_ROOT)}
    )
    bridge.wait_ready(control, php)
    bridge.beat()

    ran = bridge.enqueue("StandinSucceedWorker", {}, count=40)
    rows = bridge.wait_archived(ran, timeout=WAIT)
    assert {row.result for row in rows.values()} == {RESULT_SUCCESS}
    assert due_gauge(port, queue) == 0  # scraped while the PHP worker lives, as Prometheus does

    php.signal(signal.SIGTERM)  # a warm shutdown: the last PHP worker leaves
    php.wait(WAIT)
    stopped = time.monotonic()
    left = bridge.enqueue("StandinSucceedWorker", {}, count=20)

    # Leases sent before a survey saw it go expire within the dispatch lease; after that,
    # nothing leases the rows again: they stay due for phd or the next PHP worker.
    last_leased = [stopped]

    def quiet_for_a_survey() -> bool:
        now = time.monotonic()
        if live_leases(bridge, left):
            last_leased[0] = now
        return now - last_leased[0] > SURVEY + DISPATCH_LEASE

    bridge.wait_until(quiet_for_a_survey, WAIT, "leasing to stop")
    stopped_after = last_leased[0] - stopped
    print(f"\n[control] the last lease ended {stopped_after:.1f} s after the PHP worker left")
    assert stopped_after <= LIVENESS_TIMEOUT + DISPATCH_LEASE
    assert bridge.archived(left) == {}, "a PHP-only task ran with no PHP worker"
    assert due_gauge(port, queue) == len(left), "the control worker's gauge lost the rows"
