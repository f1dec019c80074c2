"""Prometheus metrics of a real prefork worker: outcomes summed over children, queue gauges."""

from __future__ import annotations

import socket

import requests
from prometheus_client.parser import text_string_to_metric_families

from bridge.queue.model import RESULT_FAILURE, RESULT_SUCCESS


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    text = requests.get(url, timeout=5).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_sum_outcomes_over_children_and_read_the_queue(
    make_bridge, database_url, amqp_url, tmp_path, monkeypatch
):
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc))
    port = free_port()
    bridge = make_bridge(database_url, amqp_url, METRICS_PORT=str(port))
    ok = bridge.enqueue("PhabricatorTestWorker", {}, count=6)
    bad = bridge.enqueue("PhabricatorTestWorker", {"doWork": "fail-permanent"})
    bridge.enqueue("PhpOnlyWorker", {}, count=2)  # no handler, no Conduit: left for PHP

    worker = bridge.worker("worker", [bridge.default_queue, bridge.control_queue], concurrency=2)
    bridge.beat()
    bridge.wait_ready(worker)
    archived = bridge.wait_archived(ok + bad)
    assert [archived[i].result for i in ok + bad] == [RESULT_SUCCESS] * 6 + [RESULT_FAILURE]

    url = f"http://127.0.0.1:{port}/metrics"
    outcome = "phorge_bridge_outcomes_total"
    labels = {"task_class": "PhabricatorTestWorker"}

    def counted() -> dict | None:
        found = samples(url)
        key = (outcome, frozenset({**labels, "outcome": "success"}.items()))
        return found if found.get(key) == 6 else None

    found = bridge.wait_until(counted, 20, "six successes in the metrics")
    failed = (outcome, frozenset({**labels, "outcome": "permanent-failure"}.items()))
    assert found[failed] == 1
    queued = frozenset({"task_class": "PhpOnlyWorker", "state": "queued"}.items())
    assert found[("phorge_bridge_queue_tasks", queued)] == 2
    assert found[("phorge_bridge_oldest_queued_seconds", frozenset())] >= 0
    dispatched = sum(
        value for (name, _), value in found.items() if name == "phorge_bridge_dispatched_total"
    )
    assert dispatched == 7
