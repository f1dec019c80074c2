"""Prometheus metrics of a real prefork worker started as docs/monitoring.md says (no
PROMETHEUS_MULTIPROC_DIR): outcomes summed over children, poll and queue gauges."""

from __future__ import annotations

import signal

import requests
from local_ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from bridge import __version__
from bridge.queue.model import RESULT_FAILURE, RESULT_SUCCESS


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
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    scratch = tmp_path / "tmp"  # where the worker's private metrics directory goes
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
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
    labels = {"task_class": "PhabricatorTestWorker", "implementation": "native"}

    def counted() -> dict | None:
        found = samples(url)
        key = (outcome, frozenset({**labels, "outcome": "success"}.items()))
        return found if found.get(key) == 6 else None

    found = bridge.wait_until(counted, 20, "six successes in the metrics")
    failed = (outcome, frozenset({**labels, "outcome": "permanent-failure"}.items()))
    assert found[failed] == 1
    queued = frozenset({"task_class": "PhpOnlyWorker", "state": "queued"}.items())
    assert found[("phorge_bridge_queue_tasks", queued)] == 2
    default = frozenset({"queue": bridge.default_queue}.items())
    assert found[("phorge_bridge_queue_due_tasks", default)] == 0  # PHP's two are not ours
    assert found[("phorge_bridge_oldest_due_seconds", default)] == 0
    dispatched = sum(
        value for (name, _), value in found.items() if name == "phorge_bridge_dispatched_total"
    )
    assert dispatched == 7
    assert found[("phorge_bridge_build_info", frozenset({"version": __version__}.items()))] == 1
    assert found[("phorge_bridge_poll_duration_seconds_count", frozenset())] >= 1
    assert found[("phorge_bridge_last_poll_timestamp_seconds", frozenset())] > 0
    assert found[("phorge_bridge_conduit_breaker_open", frozenset())] == 0

    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert list(scratch.iterdir()) == []  # the private directory went with the worker


def test_workers_on_one_host_take_ports_of_a_range_and_a_clash_is_one_line(
    make_bridge, database_url, amqp_url
):
    port = free_port(2)  # p and p + 1
    bridge = make_bridge(database_url, amqp_url, METRICS_PORT=f"{port}-{port + 1}")
    workers = [bridge.worker(f"worker-{n}", [bridge.default_queue]) for n in (1, 2)]
    bridge.wait_ready(*workers)

    def serving(p: int) -> bool:
        try:
            return (
                "phorge_bridge_queue_tasks"
                in requests.get(f"http://127.0.0.1:{p}/metrics", timeout=5).text
            )
        except requests.ConnectionError:
            return False

    bridge.wait_until(lambda: serving(port) and serving(port + 1), 20, "both exporters")
    logs = [w.log() for w in workers]
    assert sorted(f"metrics on 127.0.0.1:{p}" in log for log in logs for p in (port, port + 1)) == [
        False,
        False,
        True,
        True,
    ]

    bridge.settings["BRIDGE_METRICS_PORT"] = str(port)
    third = bridge.worker("worker-3", [bridge.default_queue])
    bridge.wait_ready(third)
    line = bridge.wait_until(
        lambda: [ln for ln in third.log().splitlines() if "metrics: not served" in ln],
        20,
        "the clash's log line",
    )
    assert f"no port of BRIDGE_METRICS_PORT={port} is free on 127.0.0.1" in line[0]
    assert "Traceback" not in third.log()
