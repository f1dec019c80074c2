"""The autoscaling signal on a real Prometheus, with the query the manifests ship (issue 29).

A control worker serving metrics, without PHP, and no worker of the routed queue of a
PHP-only class yet: the shipped KEDA trigger's query, evaluated through Prometheus' HTTP
API, counts the queue's due rows (the route declares who serves them: the queue can
scale from zero) and, over 10,000 rows, asks for ``maxReplicaCount``
through KEDA's formula ``ceil(value / threshold)``. It rises with the backlog, and falls
to 0 once a worker has drained it.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml
from local_ports import free_port
from php_standin import STANDIN_ROOT, php_binary

KEDA = Path(__file__).parents[2] / "deploy" / "kubernetes" / "keda"
WAIT = 120.0


def backlog_trigger(queue: str) -> tuple[str, float, int]:
    """The shipped ``search`` ScaledObject's backlog query (for ``queue``), its threshold
    and its maximum replica count."""
    scaled = yaml.safe_load((KEDA / "scaledobject-search.yaml").read_text())
    [trigger] = [t for t in scaled["spec"]["triggers"] if t["name"] == "backlog"]
    query = trigger["metadata"]["query"].replace('queue="search"', f'queue="{queue}"')
    assert queue in query, "the shipped query names its queue"
    return query, float(trigger["metadata"]["threshold"]), scaled["spec"]["maxReplicaCount"]


def replicas(value: float, threshold: float, maximum: int) -> int:
    """KEDA's (the HPA's AverageValue) replica count for a metric value."""
    return min(maximum, math.ceil(value / threshold))


def test_the_shipped_query_follows_the_backlog_and_scales_from_zero(
    make_bridge, database_url, amqp_url, start_prometheus
) -> None:
    port = free_port()
    php_binary()
    bridge = make_bridge(database_url, amqp_url, RUNNER_CLASSES="Standin*")
    bridge.route(StandinSucceedWorker="search")
    [search] = bridge.routed_queues
    query, threshold, maximum = backlog_trigger(search)
    control = bridge.worker(  # no BRIDGE_PHORGE_ROOT: it cannot run the class itself
        "control",
        [bridge.control_queue, bridge.default_queue],
        env={"BRIDGE_METRICS_PORT": str(port)},
    )
    prometheus = start_prometheus([f"127.0.0.1:{port}"])
    bridge.beat()
    bridge.wait_ready(control)
    bridge.wait_until(prometheus.ready, 30, "Prometheus to be ready")

    def signal() -> float | None:
        [sample] = prometheus.query(query) or [None]
        return None if sample is None else float(sample["value"][1])

    bridge.wait_until(lambda: signal() == 0, WAIT, "the idle queue's signal, 0")
    first = bridge.enqueue("StandinSucceedWorker", {}, count=1_000)
    bridge.wait_until(lambda: signal() == len(first), WAIT, "the signal to count 1,000 rows")
    assert 1 < replicas(len(first), threshold, maximum) < maximum, "some workers, not all"
    more = bridge.enqueue("StandinSucceedWorker", {}, count=9_000)
    total = len(first) + len(more)
    bridge.wait_until(lambda: signal() == total, WAIT, "the signal to rise with the backlog")
    assert replicas(total, threshold, maximum) == maximum, "0 workers, 10,000 rows: the maximum"

    php = {"BRIDGE_PHORGE_ROOT": str(STANDIN_ROOT)}
    worker = bridge.worker("search", [search], concurrency=4, env=php)
    bridge.wait_ready(worker)
    bridge.wait_archived(first + more, timeout=WAIT * 3)
    bridge.wait_until(lambda: signal() == 0, WAIT, "the signal to fall to 0 once drained")
