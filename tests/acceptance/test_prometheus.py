"""A real Prometheus scrapes real workers, as compose runs them: a control worker and a
routed one, both serving metrics. Every query of the shipped dashboard returns data, and
every shipped alert rule evaluates without error on what was scraped."""

from __future__ import annotations

import math
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_tools import RULES, panel_queries, prometheus_binary

SCRAPE_EVERY = "2s"  # the consumers gauge asks the workers, 1 s, once in 15 s
RATE_WINDOW = "5m"  # for Grafana's $__rate_interval: the whole test


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Prometheus:
    """A ``prometheus`` server of the test's own, on a free port, its data in tmp."""

    def __init__(self, directory: Path, targets: list[str]) -> None:
        config = {
            "global": {"scrape_interval": SCRAPE_EVERY, "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "phorge-bridge", "static_configs": [{"targets": targets}]}
            ],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = directory / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    prometheus_binary("prometheus"),
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def api(self, path: str, **params: str) -> Any:
        reply = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=5).json()
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` gives now, without its NaN elements."""
        result = self.api("query", query=expr)["result"]
        return [r for r in result if not math.isnan(float(r["value"][1]))]

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


@pytest.fixture
def start_prometheus(tmp_path: Path) -> Iterator[Callable[[list[str]], Prometheus]]:
    servers: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        servers.append(Prometheus(tmp_path, targets))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


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
