"""compose/docker-compose.yml: every worker is restarted when it dies or stops consuming,
and is scraped by the compose Prometheus, whose Grafana shows the shipped dashboard.

Docker cannot run on the test machines, so the files are checked as data: they parse,
every service restarts, and each ``celery worker`` refreshes a liveness file that its own
healthcheck reads with ``phorge-bridge health`` (and autoheal acts on), serves metrics
on the port Prometheus scrapes, and Grafana's provisioning names the dashboard's source.
(tests/acceptance/test_prometheus.py runs the dashboard's queries on a real Prometheus.)
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import yaml

COMPOSE = Path(__file__).parents[2] / "compose" / "docker-compose.yml"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def workers() -> dict[str, Any]:
    services = load(COMPOSE)["services"]
    return {n: s for n, s in services.items() if " worker " in f" {s.get('command', '')} "}


def mounts(service: dict[str, Any]) -> dict[Path, str]:
    """A service's bind mounts: the host directory (resolved) -> where it is mounted."""
    binds = [v.split(":") for v in service["volumes"] if v.startswith(".")]
    return {(COMPOSE.parent / host).resolve(): inside for host, inside, *_ in binds}


def test_every_worker_has_a_consumption_healthcheck_and_a_restart_policy():
    services = load(COMPOSE)["services"]
    assert set(workers()) == {"control", "search", "php"}
    assert all(s["restart"] == "always" for s in services.values())
    for name, service in workers().items():
        words = shlex.split(service["command"].replace("'", " "))
        liveness = words[words.index("--liveness-file") + 1]
        test = service["healthcheck"]["test"]
        assert test[:3] == ["CMD", "phorge-bridge", "health"], name
        assert test[test.index("--liveness-file") + 1] == liveness, name
        assert service["labels"]["autoheal"] == "true", name
    assert services["autoheal"]["environment"]["AUTOHEAL_CONTAINER_LABEL"] == "autoheal"


def test_prometheus_scrapes_every_worker_and_loads_the_rules():
    prometheus = load(COMPOSE)["services"]["prometheus"]
    [config_dir] = [
        host for host, inside in mounts(prometheus).items() if inside == "/etc/prometheus"
    ]
    config = load(config_dir / "prometheus.yml")
    [job] = config["scrape_configs"]
    [dns] = job["dns_sd_configs"]
    assert sorted(dns["names"]) == sorted(workers())
    for name, service in workers().items():
        assert service["environment"]["BRIDGE_METRICS_PORT"] == str(dns["port"]), name
        assert service["environment"]["BRIDGE_METRICS_ADDRESS"] == "0.0.0.0", name
        assert "PROMETHEUS_MULTIPROC_DIR" not in service["command"], name  # the bridge's own
    assert all((config_dir / rules).is_file() for rules in config["rule_files"])


def test_grafana_provisions_the_dashboard_on_the_compose_prometheus():
    grafana = load(COMPOSE)["services"]["grafana"]
    inside = {where: host for host, where in mounts(grafana).items()}
    provisioning = inside["/etc/grafana/provisioning"]
    [source] = load(provisioning / "datasources" / "prometheus.yml")["datasources"]
    assert source["url"] == "http://prometheus:9090"
    [provider] = load(provisioning / "dashboards" / "phorge-bridge.yml")["providers"]
    [dashboard] = inside[provider["options"]["path"]].glob("*.json")
    panels = [p for p in json.loads(dashboard.read_text())["panels"] if p["type"] != "row"]
    assert panels and all(p["datasource"]["uid"] == source["uid"] for p in panels)
    assert all(t["expr"] for p in panels for t in p["targets"])


def test_the_php_worker_runs_the_php_runner_on_the_mounted_checkout():
    php = load(COMPOSE)["services"]["php"]
    assert php["build"]["target"] == "php-worker" and php["profiles"] == ["php-runner"]
    [volume] = php["volumes"]
    host, inside, mode = volume.rsplit(":", 2)
    assert host == "${PHORGE_CHECKOUT:-/srv/phorge}" and mode == "ro"
    environment = php["environment"]
    assert environment["BRIDGE_PHORGE_ROOT"] == f"{inside}/phorge"
    assert environment["BRIDGE_RUNNER_RELOAD_STAMP"].startswith(f"{inside}/")
    assert "bridge.control" in php["command"]  # the poller must see the checkout too
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    assert "FROM bridge AS php-worker" in dockerfile and "php-cli" in dockerfile
    others = [s for n, s in load(COMPOSE)["services"].items() if "build" in s and n != "php"]
    assert all(s["build"]["target"] == "bridge" for s in others)
