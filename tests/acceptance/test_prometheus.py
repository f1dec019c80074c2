"""A real Prometheus scrapes real workers, as compose runs them: a control worker and a
routed one, both serving metrics. Every query of the shipped dashboard returns data, and
every shipped alert rule evaluates without error on what was scraped."""

from __future__ import annotations

import yaml
from local_ports import free_port
from prometheus_tools import RULES, panel_queries

RATE_WINDOW = "5m"  # for Grafana's $__rate_interval: the whole test


def test_every_dashboard_query_has_data_from_every_worker(
    make_bridge, database_url, amqp_url, start_prometheus
):
    ports = [free_port(), free_port()]
    bridge = make_bridge(database_url, amqp_url, METRICS_PORT=str(ports[0]))
    bridge.route(PhabricatorTestWorker="search")

    def run_wave() -> None:
        ids = bridge.enqueue("PhabricatorTestWorker", {}, count=15)
        ids += bridge.enqueue("PhabricatorTestWorker", {"doWork": "fail-permanent"})
        bridge.wait_archived(ids)

    control = bridge.worker("control", [bridge.control_queue, bridge.default_queue])
    bridge.settings["BRIDGE_METRICS_PORT"] = str(ports[1])
    search = bridge.worker("search", bridge.routed_queues, concurrency=2)
    prometheus = start_prometheus([f"127.0.0.1:{port}" for port in ports])
    bridge.beat()
    bridge.wait_ready(control, search)
    bridge.wait_until(prometheus.ready, 20, "Prometheus to be ready")
    run_wave()
    # A rate needs two samples of a series: a second wave once the first one's counters
    # were scraped, so each rate of the dashboard has something to say.
    outcomes = 'phorge_bridge_outcomes_total{outcome="permanent-failure"}'
    bridge.wait_until(lambda: prometheus.query(outcomes), 20, "the first wave scraped")
    run_wave()
    up = 'up{job="phorge-bridge"} == 1'
    bridge.wait_until(lambda: len(prometheus.query(up)) == 2, 20, "both workers scraped")
    for title, expr in panel_queries():
        if "phorge_bridge_canary_" in expr:
            continue  # only a class shared between two sides has them: test_canary.py
        expr = expr.replace("$__rate_interval", RATE_WINDOW)
        bridge.wait_until(lambda e=expr: prometheus.query(e), 20, f"{title!r}: {expr}")
    ran = 'sum by (instance) (phorge_bridge_outcomes_total{task_class="PhabricatorTestWorker"})'

    def ran_by_worker() -> dict[str, float]:
        return {r["metric"]["instance"]: float(r["value"][1]) for r in prometheus.query(ran)}

    # The routed worker ran all 32, and its counts are scraped, not only the control one's.
    searched = {f"127.0.0.1:{ports[1]}": 32}
    bridge.wait_until(lambda: ran_by_worker() == searched, 20, f"{searched} from {ran}")
    groups = prometheus.api("rules")["groups"]
    shipped = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert [r["health"] for g in groups for r in g["rules"]] == ["ok"] * shipped, groups
